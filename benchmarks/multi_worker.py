"""Accumulation where communication costs: all-reduces between worker processes.

    .venv/bin/python -m benchmarks.multi_worker                # docs/performance/multi-worker.*
    .venv/bin/python -m benchmarks.multi_worker --quick        # smoke size, in benchmarks/results
    .venv/bin/python -m benchmarks.multi_worker --report-only  # re-render from the JSON

The one-process benchmark (`benchmarks.run`) all-reduces between logical devices of one
process: a memory copy, so the k - 1 all-reduces that accumulation saves per update cost
almost nothing there. Here every replica is a worker *process* of a local
`MultiWorkerMirroredStrategy` cluster, and the gradients travel between processes over
gRPC on the loopback, as between hosts.

Each configuration runs its workers in a network namespace of their own (`unshare
--net`, root): its loopback carries only their traffic, so its byte counter measures what
they sent, and a token-bucket qdisc (`tc ... tbf`) on it can limit the rate, as a link
between separate hosts would. Where `unshare --net` is refused, the workers run in this
namespace, bytes are not measured and the rate-limited configuration is skipped, and the
JSON says why.

Per configuration (workers, rate), for each k in a cluster of its own (a worker process
keeps the memory it allocated), in paired interleaved rounds (`benchmarks.worker_bench`):
the plain per-micro-batch step (one update and one all-reduce per micro-batch),
`GradientAccumulator` and `AccumulatingOptimizer` (custom loop), `MicroBatching` (fit's
`train_step`) and the 0/1 mask trick (fit), each training the same block of
micro-batches of `per_worker_batch` examples per worker; and the *compute-only* step: the
plain step on a model outside the strategy, on every worker at once (the same per-worker
work on the same cores, no all-reduce). One more configuration runs the compute-only
step on one worker alone.

Reported: time per example (the block's time / examples of all workers), loopback bytes
per update, and per (configuration, approach) a least-squares fit of time per example
= compute + all-reduce / k to the points (`fit_line`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # `python benchmarks/multi_worker.py`
    sys.path.insert(0, str(ROOT))

from benchmarks.worker_bench import KEYS, block_of  # noqa: E402 - after the sys.path fix

DOCS_OUT = ROOT / "docs" / "performance"
QUICK_OUT = ROOT / "benchmarks" / "results" / "quick"
JSON_NAME = "multi_worker.json"
TABLE_NAME = "multi-worker.md"
FIGURE_NAME = "multi-worker.png"
LABELS = {"plain": "plain micro-batch step", "gradient_accumulator": "GradientAccumulator",
          "accumulating_optimizer": "AccumulatingOptimizer",
          "micro_batching": "MicroBatching train_step", "mask_trick": "0/1 mask trick",
          "compute_only": "compute only (no all-reduce)"}
ACCUMULATING = ("gradient_accumulator", "accumulating_optimizer", "micro_batching")
ALL_KS = [1, 2, 4, 8, 16]

PRESETS = {
    "cpu": {
        # 1024 -> 6 x Dense(2048) -> 1: 23.1 M parameters, 92 MB of float32 gradients.
        "sizes": {"features": 1024, "hidden": 2048, "layers": 6, "per_worker_batch": 32,
                  "block": 4},
        "configs": [
            {"name": "1 worker alone", "workers": 1, "rate": None, "keys": ["compute_only"],
             "ks": [1], "rounds": 3},
            {"name": "2 workers", "workers": 2, "rate": None, "keys": list(KEYS),
             "ks": ALL_KS, "rounds": 3},
            {"name": "4 workers", "workers": 4, "rate": None, "keys": list(KEYS),
             "ks": ALL_KS, "rounds": 3},
            {"name": "2 workers, 5 Gbit/s", "workers": 2, "rate": "5gbit",
             "keys": ["plain", "gradient_accumulator", "accumulating_optimizer",
                      "compute_only"], "ks": [1, 4, 16], "rounds": 2},
        ],
    },
    "quick": {
        # 9 k parameters: a gradient all-reduce's bytes well above a small one's framing
        # (the finiteness flag), so bytes per update tell 1 all-reduce from k.
        "sizes": {"features": 16, "hidden": 512, "layers": 1, "per_worker_batch": 4,
                  "block": 2},
        "configs": [
            {"name": "1 worker alone", "workers": 1, "rate": None, "keys": ["compute_only"],
             "ks": [1], "rounds": 1},
            {"name": "2 workers", "workers": 2, "rate": None, "keys": list(KEYS),
             "ks": [1, 2], "rounds": 2},
            {"name": "2 workers, 100 Mbit/s", "workers": 2, "rate": "100mbit",
             "keys": ["plain", "accumulating_optimizer"], "ks": [2], "rounds": 1},
        ],
    },
}


def _log(message: str) -> None:
    print(f"[multi-worker {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- running a configuration -----------------------------------------------------------


def namespace_refusal() -> str | None:
    """None if `unshare --net` can make a network namespace here, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is not installed"
    try:
        done = subprocess.run(["unshare", "--net", "--", "ip", "link", "set", "lo", "up"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return f"unshare --net failed: {err}"
    if done.returncode != 0:
        return f"unshare --net failed: {done.stderr.strip() or done.returncode}"
    return None


def threads_per_worker(workers: int) -> int:
    """Intra-op threads of each worker: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // workers)


def _inside(job_path: str, out_path: str) -> None:
    """In the namespace: bring up the loopback, shape it, run the workers, write JSON."""
    with open(job_path) as f:
        job = json.load(f)
    if job["namespace"]:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        if job["rate"]:
            # burst: at least rate / HZ; 1 MB covers 5 Gbit/s at HZ=250 and more.
            subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                            job["rate"], "burst", "1mb", "latency", "100ms"], check=True)
    from distgrad_course.lab.local_cluster import run_workers

    # One cluster per k: a worker process keeps what it allocated (4 workers measured
    # here: about 2 GB each for k = 16 alone, 5 GB each after all five k in one process).
    per_k = []
    for k in job["ks"]:
        results = run_workers("benchmarks.worker_bench:bench_worker",
                              num_workers=job["workers"], timeout=job["timeout"],
                              env={"PYTHONPATH": str(ROOT)}, sizes=job["sizes"], ks=[k],
                              rounds=job["rounds"], keys=job["keys"],
                              threads=threads_per_worker(job["workers"]))
        per_k.append([result.check().value for result in results])
    with open(out_path, "w") as f:
        json.dump(merge_clusters(per_k), f)


def merge_clusters(per_k: list) -> list:
    """One JSON per worker from one list of workers' JSON per k (pure function)."""
    merged = []
    for runs in zip(*per_k):  # the same worker in each cluster
        worker = dict(runs[0])
        worker["times"] = {k: t for run in runs for k, t in run["times"].items()}
        worker["bytes"] = None if runs[0]["bytes"] is None else {
            k: b for run in runs for k, b in run["bytes"].items()}
        worker["per_replica_batch"] = next((run["per_replica_batch"] for run in runs
                                            if run["per_replica_batch"] is not None), None)
        merged.append(worker)
    return merged


def run_config(config: dict, sizes: dict, refusal: str | None, timeout: float) -> dict:
    """One configuration's workers, in a namespace of their own where allowed."""
    with tempfile.TemporaryDirectory(prefix="distgrad-mw-") as tmp:
        job = {**config, "sizes": sizes, "namespace": refusal is None, "timeout": timeout}
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        command = [sys.executable, "-m", "benchmarks.multi_worker", "--inside", job_path,
                   out_path]
        if refusal is None:
            command = ["unshare", "--net", "--", *command]
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout + 120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"configuration {config['name']!r} failed "
                               f"({done.returncode}):\n{done.stderr[-4000:]}")
        with open(out_path) as f:
            workers = json.load(f)
    return {**config, "seconds": round(time.monotonic() - started, 1),
            **summarize(workers, config, sizes)}


def summarize(workers: list, config: dict, sizes: dict) -> dict:
    """Per key and k: block seconds per round (chief; compute-only: slowest worker),
    seconds per example, loopback bytes per update (pure function of the workers' JSON)."""
    chief = workers[0]
    rows = {}
    for key in config["keys"]:
        rows[key] = {}
        for k in config["ks"]:
            block = block_of(sizes["block"], k)
            examples = block * sizes["per_worker_batch"] * config["workers"]
            if key == "compute_only":
                seconds = [max(per_round) for per_round in
                           zip(*(w["times"][str(k)][key] for w in workers))]
            else:
                seconds = chief["times"][str(k)][key]
            block_bytes = [b for b in chief["bytes"][str(k)][key] if b is not None]
            updates = block // k
            rows[key][str(k)] = {
                "block_seconds": seconds,
                "seconds_per_example": [s / examples for s in seconds],
                "bytes_per_update": median(block_bytes) / updates if block_bytes else None,
            }
    return {"rows": rows, "parameters": chief["parameters"], "threads": chief["threads"],
            "per_replica_batch": chief["per_replica_batch"]}


# --- the fitted line --------------------------------------------------------------------


def median(values: list) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def fit_line(points: list) -> dict:
    """Least squares of `t = compute + all_reduce / k` through `[(k, t), ...]` (pure).

    Returns `compute` (the limit as k grows), `all_reduce` (what one update's all-reduce
    and apply add, spread over k micro-batches) and `r2`. Needs two distinct k.
    """
    if len({k for k, _ in points}) < 2:
        raise ValueError("fit_line needs points at two or more distinct k.")
    xs = [1.0 / k for k, _ in points]
    ts = [t for _, t in points]
    mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx
    intercept = mt - slope * mx
    residual = sum((t - intercept - slope * x) ** 2 for x, t in zip(xs, ts))
    total = sum((t - mt) ** 2 for t in ts)
    return {"compute": intercept, "all_reduce": slope,
            "r2": 1.0 - residual / total if total > 0 else 1.0}


def fits(config: dict) -> dict:
    """`fit_line` of every accumulating approach of `config` over all its rounds."""
    out = {}
    for key in ACCUMULATING:
        row = config["rows"].get(key)
        if row is None or len(row) < 2:
            continue
        out[key] = fit_line([(int(k), t) for k, cell in row.items()
                             for t in cell["seconds_per_example"]])
    return out


def verdict(times: list, baseline: list) -> str:
    """Paired per round: 'faster' / 'slower' when every round agrees, else 'not resolvable'."""
    ratios = [t / b for t, b in zip(times, baseline)]
    if max(ratios) < 1:
        return "faster"
    if min(ratios) > 1:
        return "slower"
    return "not resolvable"


# --- the page: table and figure ----------------------------------------------------------


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def _cell(values: list) -> str:
    return f"{_us(median(values))} ({_us(min(values))}…{_us(max(values))})"


def _bytes(value) -> str:
    if value is None:
        return "not measured"
    if value >= 1e7:
        return f"{value / 1e6:.0f} MB"
    return f"{value / 1e6:.1f} MB" if value >= 1e6 else f"{value / 1e3:.1f} kB"


def table(results: dict) -> str:
    """Markdown: per configuration, µs per example and MB per update for each k."""
    parts = []
    alone = next((c for c in results["configs"] if c["workers"] == 1), None)
    for config in results["configs"]:
        if config["workers"] == 1:
            continue
        ks = config["ks"]
        head = "| approach | " + " | ".join(f"k = {k}" for k in ks) + " |"
        lines = [f"**{config['name']}** — µs per example, median (min…max) of "
                 f"{config['rounds']} rounds; bytes on the loopback per update (all workers); "
                 "faster or slower than the plain step in every round, or not resolvable",
                 "", head,
                 "|---|" + "---:|" * len(ks)]
        plain = config["rows"].get("plain")
        for key in config["keys"]:
            cells = []
            for k in ks:
                cell = config["rows"][key][str(k)]
                text = f"{_cell(cell['seconds_per_example'])}<br>{_bytes(cell['bytes_per_update'])}"
                if plain is not None and key not in ("plain", "compute_only"):
                    text += "<br>" + verdict(cell["block_seconds"],
                                             plain[str(k)]["block_seconds"])
                cells.append(text)
            lines.append(f"| {LABELS[key]} | " + " | ".join(cells) + " |")
        if alone is not None:
            one = alone["rows"]["compute_only"]["1"]["seconds_per_example"]
            ideal = [t / config["workers"] for t in one]
            lines.append(f"| compute only, 1 worker alone ÷ {config['workers']} | "
                         + " | ".join(_cell(ideal) for _ in ks) + " |")
        fitted = fits(config)
        if fitted:
            lines += ["", "Fitted time per example = compute + all-reduce / k (µs): "
                      + "; ".join(f"{LABELS[key]} {_us(f['compute'])} + {_us(f['all_reduce'])}"
                                  f" / k (R² {f['r2']:.2f})" for key, f in fitted.items())
                      + "."]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def figure(results: dict, path: Path) -> Path:
    """One panel per configuration of 2+ workers: µs per example against k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in results["configs"] if c["workers"] > 1]
    alone = next((c for c in results["configs"] if c["workers"] == 1), None)
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 3.8),
                             squeeze=False, sharey=False)
    colors = {"plain": "#d62728", "gradient_accumulator": "#1f77b4",
              "accumulating_optimizer": "#2ca02c", "micro_batching": "#9467bd",
              "mask_trick": "#ff7f0e", "compute_only": "#7f7f7f"}
    for ax, config in zip(axes[0], configs):
        fitted = fits(config)
        ks = [int(k) for k in config["ks"]]
        for key in config["keys"]:
            cells = [config["rows"][key][str(k)]["seconds_per_example"] for k in ks]
            mid = [median(c) * 1e6 for c in cells]
            low = [m - min(c) * 1e6 for m, c in zip(mid, cells)]
            high = [max(c) * 1e6 - m for m, c in zip(mid, cells)]
            style = "s" if key in ("plain", "mask_trick", "compute_only") else "o"
            ax.errorbar(ks, mid, yerr=[low, high], fmt=style, color=colors[key],
                        label=LABELS[key], capsize=2, markersize=4)
            if key in fitted:
                grid = [ks[0] * (ks[-1] / ks[0]) ** (i / 40) for i in range(41)]
                line = fitted[key]
                ax.plot(grid, [(line["compute"] + line["all_reduce"] / k) * 1e6 for k in grid],
                        color=colors[key], linewidth=1, alpha=0.7)
        if alone is not None:
            one = median(alone["rows"]["compute_only"]["1"]["seconds_per_example"])
            ax.axhline(one / config["workers"] * 1e6, color="black", linestyle=":",
                       linewidth=1, label="compute only, 1 worker alone ÷ workers")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("k (micro-batches per update)")
        ax.set_title(config["name"], fontsize=10)
    axes[0][0].set_ylabel("µs per example (all workers)")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def description(results: dict) -> str:
    env = results["environment"]
    sizes = results["sizes"]
    refusal = env["namespace_refusal"]
    where = ("each configuration in its own network namespace (bytes: its loopback counter)"
             if refusal is None else f"in this network namespace ({refusal}: bytes not measured)")
    return (f"Run of {env['date']} (`{env['command']}`, {env['seconds']:.0f} s, on top of "
            f"commit {env['commit']}): TensorFlow {env['tensorflow']}, Keras {env['keras']}, "
            f"Python {env['python']}; {env['cores']} CPU cores, no GPU; 1-minute load "
            f"average {env['load_start']:.1f} at the start, {env['load_end']:.1f} at the end. "
            f"Workers: local `MultiWorkerMirroredStrategy` processes over gRPC, {where}. "
            f"Model: {sizes['features']} inputs, {sizes['layers']} × Dense({sizes['hidden']}, "
            f"tanh), Dense(1), float32, SGD, {results['parameters']:,} parameters "
            f"({results['parameters'] * 4 / 1e6:.0f} MB of gradients); "
            f"{sizes['per_worker_batch']} examples per worker per micro-batch; "
            f"a timed block of max({sizes['block']}, k) micro-batches, the same for every "
            f"approach of one k; intra-op threads "
            f"per worker: the cores shared out ("
            + ", ".join(f"{c['workers']} worker(s): {c['threads']}"
                        for c in results["configs"]) + ").\n")


def write_report(results: dict, out: Path) -> list[Path]:
    (out / TABLE_NAME).write_text(description(results) + "\n" + table(results))
    return [out / TABLE_NAME, figure(results, out / FIGURE_NAME)]


# --- main --------------------------------------------------------------------------------


def _git_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, timeout=10, check=False)
    return done.stdout.strip() or None


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_worker",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke size (a minute): checks the pipeline, not performance")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default docs/performance; quick: "
                             "benchmarks/results/quick)")
    parser.add_argument("--report-only", action="store_true",
                        help="only re-render the table and figure from OUT/multi_worker.json")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds one configuration may take (default 3600)")
    parser.add_argument("--inside", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.inside:
        _inside(*args.inside)
        return 0
    out = args.out or (QUICK_OUT if args.quick else DOCS_OUT)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = json.loads((out / JSON_NAME).read_text())
        for path in write_report(results, out):
            _log(f"wrote {path}")
        return 0
    import keras
    import tensorflow as tf

    preset = PRESETS["quick" if args.quick else "cpu"]
    refusal = namespace_refusal()
    started, load_start = time.monotonic(), os.getloadavg()[0]
    configs = []
    for config in preset["configs"]:
        if config["rate"] and refusal is not None:
            _log(f"skipped {config['name']!r}: no network namespace ({refusal})")
            continue
        _log(f"running {config['name']!r} ...")
        configs.append(run_config(config, preset["sizes"], refusal, args.timeout))
        _log(f"{config['name']!r} took {configs[-1]['seconds']} s")
    results = {
        "schema": 1,
        "environment": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m benchmarks.multi_worker" + (" --quick" if args.quick else ""),
            "seconds": time.monotonic() - started, "commit": _git_commit(),
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "python": platform.python_version(), "cores": os.cpu_count(),
            "load_start": load_start, "load_end": os.getloadavg()[0],
            "namespace_refusal": refusal},
        "sizes": preset["sizes"],
        "parameters": next(c["parameters"] for c in configs),
        "configs": configs,
    }
    (out / JSON_NAME).write_text(json.dumps(results, indent=1) + "\n")
    for path in [out / JSON_NAME, *write_report(results, out)]:
        _log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
