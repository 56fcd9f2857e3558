"""Run every benchmark in one process; write the JSON, the page's tables and plots.

    .venv/bin/python -m benchmarks.run              # docs/performance/ (docs/performance.md
                                                    # includes its tables)
    .venv/bin/python -m benchmarks.run --quick      # smoke size -> benchmarks/results/quick/
    .venv/bin/python -m benchmarks.run --report-only  # re-render tables/plots from the JSON

What runs, in order (see `benchmarks.approaches` for the runners):

1. **main**: every approach at k = `--k` (default 4), without a strategy and under
   `MirroredStrategy` with `--replicas` replicas, `repeats` interleaved rounds;
2. a **profiler trace** of one update of every runner of both main groups: all-reduces
   (graph, derived and measured in the distributed group) and the accumulation's own
   kernels' share of op time (`benchmarks.trace`); **allocator memory** of one update;
3. **scaling in k**: our approaches and the baselines at every k of `--ks`, distributed
   (a profiler trace of one update each: measured all-reduces, op time);
4. **scaling in replicas**: the same at k = `--k` on one replica (MirroredStrategy over
   one device); the no-strategy and distributed points come from the main groups;
5. **peak RSS** of micro-batching vs plain B/k vs plain B, each in a fresh process
   (`benchmarks.measure.fresh_process_memory`).

On a machine with GPUs the replicas are GPUs (`distgrad_course.make_strategy`), the `gpu`
size preset is used, and the results file gets a `-gpu` suffix, so CPU and GPU results
live side by side and the page shows both (`benchmarks.report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# oneDNN's CPU allocator keeps the allocator statistic the memory tables read; TF turns
# oneDNN on by default only on some CPUs (AVX-512 and newer), so ask for it everywhere.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # `python benchmarks/run.py`: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))
DOCS_OUT = ROOT / "docs" / "performance"
QUICK_OUT = ROOT / "benchmarks" / "results" / "quick"
SCHEMA = 1
SECTIONS = ("main", "scaling_k", "scaling_replicas", "fresh_processes")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke size (seconds): checks the pipeline, not performance")
    parser.add_argument("--preset", choices=("quick", "cpu", "gpu"),
                        help="model/timing sizes (default: gpu with GPUs, else cpu)")
    parser.add_argument("--replicas", type=int, default=2,
                        help="replicas of the distributed runs (default 2)")
    parser.add_argument("--k", type=int, default=None,
                        help="accumulation steps of the main comparison (default 4; quick 2)")
    parser.add_argument("--ks", type=str, default=None,
                        help="comma-separated k for the scaling sweep (default 1,2,4,8; quick 1,2)")
    parser.add_argument("--repeats", type=int, default=None, help="override the preset's rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default docs/performance; quick: "
                             "benchmarks/results/quick)")
    parser.add_argument("--report-only", action="store_true",
                        help="only re-render the tables and plots from OUT/results*.json")
    parser.add_argument("--require-gpu", action="store_true",
                        help="exit with an error unless TensorFlow sees a GPU (benchmarks/gpu.sh)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    return parser.parse_args(argv)


def _defaults(args):
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DOCS_OUT
    if args.k is None:
        args.k = 2 if args.quick else 4
    ks = args.ks or ("1,2" if args.quick else "1,2,4,8")
    args.ks = sorted({int(k) for k in ks.split(",")} | {args.k})
    args.sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown --sections {unknown}; choose from {', '.join(SECTIONS)}.")
    if args.replicas < 2:
        raise SystemExit("--replicas must be >= 2: the benchmark compares distributed runs.")
    return args


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _log(message: str) -> None:
    print(f"[benchmarks {time.strftime('%H:%M:%S')}] {message}", flush=True)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _plain_text(message: str) -> str:
    """`message` without terminal colour codes (Keras wraps layer errors in them)."""
    return _ANSI.sub("", message)


def _failed_row(failed) -> dict:
    return {"key": failed.key, "label": failed.label, "path": failed.path,
            "role": failed.role, "ours": failed.ours,
            "status": "error" if failed.error else "not run",
            "error": None if failed.error is None else
            {"type": failed.error.type, "message": _plain_text(failed.error.message)},
            "reason": failed.reason}


def _timed_row(runner, micro_batches, times, cpu_times, baseline=None, cpu_baseline=None):
    from benchmarks.measure import paired_ratios, summary

    row = {**runner.describe(), "status": "ok", "seconds": times, "cpu_seconds": cpu_times}
    for key, values in (("ms_per_micro_batch", times), ("cpu_ms_per_micro_batch", cpu_times)):
        row[key] = summary([1e3 * t / micro_batches for t in values])
    if baseline is not None:
        row["vs_baseline"] = summary(paired_ratios(times, baseline))
        for key, mine, theirs in (("overhead_percent", times, baseline),
                                  ("cpu_overhead_percent", cpu_times, cpu_baseline)):
            row[key] = summary([100.0 * (r - 1.0) for r in paired_ratios(mine, theirs)])
    return row


def _time_group(name, strategy_name, strategy, classes, sizes, k, repeats, physical_gpus,
                traced: str = "none", memory: bool = False) -> dict:
    """Build `classes` at k under `strategy`, time them round-robin; one group record.

    `traced`: "none", "measured" (a profiler trace of one update: measured all-reduces
    and op time) or "graph" (also the graph placement and derived counts).
    """
    from benchmarks import approaches
    from benchmarks.measure import allocator_record, timed_rounds, traced_update
    from benchmarks.runners import Failed, block_data

    started = time.perf_counter()
    load = os.getloadavg()
    x, y = block_data(sizes, k)
    built = []
    for cls in classes:
        t0 = time.perf_counter()
        built.append(approaches.build(cls, strategy, sizes, k, x, y))
        status = "not run" if isinstance(built[-1], Failed) else "ok"
        _log(f"{name} {strategy_name} k={k}: built {cls.key} ({status}, "
             f"{time.perf_counter() - t0:.1f} s)")
    runners = [r for r in built if not isinstance(r, Failed)]
    for runner in runners:  # a second untimed run: caches warm, allocator settled
        runner.run(1)
    updates = sizes.block_updates(k)
    micro_batches = updates * k
    times, cpu_times = timed_rounds(runners, lambda r: updates, repeats)
    baseline = {r.path: r.key for r in runners if r.role == "baseline"}
    rows = []
    for item in built:
        if isinstance(item, Failed):
            rows.append(_failed_row(item))
            continue
        # Every runner but the baselines is compared with its path's plain step (the
        # floor too: its ratio is the share of a step that is not compute).
        base = baseline.get(item.path) if item.role != "baseline" else None
        rows.append(_timed_row(item, micro_batches, times[item.key], cpu_times[item.key],
                               times.get(base), cpu_times.get(base)))
    by_key = {r.key: r for r in runners}
    measured = [(row, by_key[row["key"]]) for row in rows
                if row["key"] in by_key and by_key[row["key"]].role != "floor"]
    if traced != "none":
        for row, runner in measured:
            try:
                row["all_reduces"], row["op_time"] = traced_update(
                    runner, updates=1, with_graph=traced == "graph")
            except Exception as err:  # recorded on the row
                row["all_reduces"] = {"error": f"{type(err).__name__}: {err}"}
        _log(f"{name} {strategy_name} k={k}: profiler traces taken")
    if memory:
        for row, runner in measured:
            row["memory"] = allocator_record(runner, physical_gpus)
        _log(f"{name} {strategy_name} k={k}: allocator memory measured")
    record = {"section": name, "strategy": strategy_name,
              "replicas": strategy.num_replicas_in_sync, "k": k, "repeats": repeats,
              "updates_per_block": updates, "micro_batches_per_block": micro_batches,
              "load_average_at_start": list(load), "seconds": time.perf_counter() - started,
              "rows": rows}
    del built, runners, by_key, measured
    gc.collect()
    _log(f"{name} {strategy_name} k={k}: done in {record['seconds']:.1f} s")
    return record


def measure(args) -> dict:
    """Run every section; returns the results record (also what is written as JSON)."""
    started_wall = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    import distgrad_course
    from distgrad_course.devices import replica_devices

    replica_devices(args.replicas)  # logical devices first, before any other TF work
    import tensorflow as tf

    from benchmarks import approaches, fit_runners, runners
    from benchmarks import measure as measures

    physical_gpus = len(tf.config.list_physical_devices("GPU"))
    if args.require_gpu and not physical_gpus:
        raise SystemExit("benchmarks: no GPU visible to TensorFlow; this run measures GPU "
                         "figures only. Install tensorflow[and-cuda] (docs/guides/gpu.md).")
    preset = args.preset or ("quick" if args.quick else "gpu" if physical_gpus else "cpu")
    sizes = runners.PRESETS[preset]
    if args.repeats:
        sizes = dataclasses.replace(sizes, repeats=args.repeats, scaling_repeats=args.repeats)
    # One strategy object per replica count, reused by every runner (make_strategy caches
    # one per device set): two MirroredStrategy objects over the same devices start from
    # the same collective group and instance keys (cross_device_utils.CollectiveKeys,
    # INSTANCE_KEY_START_NUMBER) and their all-reduces collide ("Shape mismatch in the
    # collective instance 100", tensorflow/tensorflow#62790).
    strategies = {"none": tf.distribute.get_strategy(),
                  "R1": distgrad_course.make_strategy(1),
                  f"R{args.replicas}": distgrad_course.make_strategy(args.replicas)}
    distributed = f"R{args.replicas}"
    label = "gpu" if physical_gpus else "cpu"
    _log(f"preset {preset} {sizes}, k={args.k}, ks={args.ks}, strategies {list(strategies)}")

    main_classes = list(approaches.MAIN_ORDER)
    if preset == "quick":  # the floors are plain runners on another model: same code
        main_classes = [c for c in main_classes if c.role != "floor"]
    scaling_classes = list(approaches.SCALING)
    groups = []
    if "main" in args.sections:
        groups.append(_time_group("main", "none", strategies["none"], main_classes, sizes,
                                  args.k, sizes.repeats, physical_gpus, traced="measured"))
        groups.append(_time_group("main", distributed, strategies[distributed], main_classes,
                                  sizes, args.k, sizes.repeats, physical_gpus,
                                  traced="graph", memory=True))
    if "scaling_k" in args.sections:
        for k in args.ks:
            if k == args.k and "main" in args.sections:
                continue
            groups.append(_time_group("scaling_k", distributed, strategies[distributed],
                                      scaling_classes, sizes, k, sizes.scaling_repeats,
                                      physical_gpus, traced="measured"))
    if "scaling_replicas" in args.sections:
        groups.append(_time_group("scaling_replicas", "R1", strategies["R1"], scaling_classes,
                                  sizes, args.k, sizes.scaling_repeats, physical_gpus,
                                  traced="measured"))
    # After every timing, so nothing else competes for the cores while timing.
    fresh = (measures.fresh_process_memory(sizes, args.k, args.replicas, physical_gpus, _log)
             if "fresh_processes" in args.sections else [])
    pypi_version, pypi_error = fit_runners.pypi_package_status()
    pypi_optimizer = (fit_runners.pypi_optimizer_error()
                      if pypi_version and pypi_error is None else None)
    return {
        "schema": SCHEMA,
        "label": label,
        "preset": preset,
        "command": " ".join(["python -m benchmarks.run", *sys.argv[1:]]),
        "started": started,
        "wall_seconds": time.perf_counter() - started_wall,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_average_start": list(load_start),
                    "load_average_end": list(os.getloadavg()),
                    "tf_enable_onednn_opts": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                    "shared": "other engineers' work ran on the same cores" if label == "cpu"
                    else None},
        "git_commit": _git_commit(),
        "environment": distgrad_course.environment_report(strategies[distributed]),
        "sizes": dataclasses.asdict(sizes),
        "optimizer": f"keras.optimizers.SGD(learning_rate={runners.LEARNING_RATE})",
        "k": args.k,
        "ks": args.ks,
        "sections": args.sections,
        "replicas": args.replicas,
        "pypi_package": {"name": fit_runners.PYPI_PACKAGE, "version": pypi_version,
                         "import_error": None if pypi_error is None else
                         {"type": pypi_error.type, "message": pypi_error.message},
                         "optimizer_error": None if pypi_optimizer is None else
                         {"type": pypi_optimizer.type,
                          "message": _plain_text(pypi_optimizer.message)}},
        "groups": groups,
        "fresh_process_memory": fresh,
    }


def main(argv=None) -> int:
    args = _defaults(_parse(argv))
    from benchmarks import report
    from benchmarks.rows import results_file

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        results = measure(args)
        path = results_file(args.out, results["label"])
        path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        _log(f"wrote {path} ({results['wall_seconds']:.0f} s)")
    written = report.render_all(args.out)
    for path in written:
        _log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
