"""Turn `results*.json` into markdown tables, PNG plots and the docs' Performance page.

Every number on the page comes from a results file written by `benchmarks.run`; the
prose around the tables is fixed text, and the sentences that judge a number (the
3 % target, which approach ran where) are computed from the file. A GPU section is
filled only from `results-gpu.json`, i.e. from a run on GPUs (`benchmarks/gpu.sh`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

TARGET_PERCENT = 3.0
MIB = 2**20
LABELS = ("cpu", "gpu")
PATH_ORDER = ("fit", "custom loop")
STRATEGY_TITLES = {"none": "no strategy (one device)", "R1": "MirroredStrategy, 1 replica"}


def results_file(out_dir: Path, label: str) -> Path:
    return out_dir / ("results.json" if label == "cpu" else f"results-{label}.json")


def suffix(label: str) -> str:
    return "" if label == "cpu" else f"-{label}"


def load_results(out_dir: Path) -> dict:
    """`{label: results}` for every results file present in `out_dir`."""
    found = {}
    for label in LABELS:
        path = results_file(out_dir, label)
        if path.is_file():
            found[label] = json.loads(path.read_text(encoding="utf-8"))
    return found


# --- formatting ---------------------------------------------------------------------


def strategy_title(name: str) -> str:
    if name in STRATEGY_TITLES:
        return STRATEGY_TITLES[name]
    return f"MirroredStrategy, {name[1:]} replicas"


def pct(value: float) -> str:
    return f"{value:+.1f} %"


def spread(stats: dict) -> str:
    return f"{stats['min']:+.1f} … {stats['max']:+.1f}"


def iqr(stats: dict) -> str:
    return f"{stats['q1']:+.1f} … {stats['q3']:+.1f}"


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def short_error(row: dict, limit: int = 150) -> str:
    """One line saying why a row did not run."""
    if row.get("reason"):
        return row["reason"]
    error = row.get("error") or {}
    message = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", error.get("message", "")).split())
    if len(message) > limit:
        message = message[:limit].rstrip() + " …"
    return f"`{error.get('type', 'Error')}`: {message}"


def row_name(row: dict) -> str:
    name = row["label"]
    return f"**{name}** (distgrad)" if row.get("ours") else name


def groups_of(results: dict, section: str) -> list:
    return [g for g in results.get("groups", []) if g["section"] == section]


def main_group(results: dict, strategy: str | None = None):
    groups = groups_of(results, "main")
    if strategy is None:  # the distributed one
        groups = [g for g in groups if g["replicas"] > 1]
    else:
        groups = [g for g in groups if g["strategy"] == strategy]
    return groups[0] if groups else None


def ordered_rows(group: dict, roles=("baseline", "approach", "reference")) -> list:
    rows = [r for r in group["rows"] if r["role"] in roles]
    rank = {"baseline": 0, "approach": 1, "reference": 2, "floor": 3}
    return sorted(rows, key=lambda r: (PATH_ORDER.index(r["path"]), rank[r["role"]],
                                       not r.get("ours")))


# --- tables --------------------------------------------------------------------------


def overhead_table(group: dict) -> str:
    lines = [
        ("| approach | path | ms per micro-batch (median) | overhead vs plain micro-batch "
        f"step (median) | min … max | quartiles | by CPU time (median) | ≤ {TARGET_PERCENT:g} % |"),
        "|---|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in ordered_rows(group):
        head = f"| {row_name(row)} | {row['path']} "
        if row["status"] != "ok":
            lines.append(f"{head}| did not run: {cell(short_error(row))} | | | | | |")
            continue
        ms = f"{row['ms_per_micro_batch']['median']:.2f}"
        if row["role"] == "baseline":
            lines.append(f"{head}| {ms} | baseline | | | | |")
            continue
        ov = row["overhead_percent"]
        verdict = ("yes" if ov["median"] <= TARGET_PERCENT else "no") if row.get("ours") else ""
        if row["role"] == "reference":
            verdict = "(reference)"
        cpu = row.get("cpu_overhead_percent")
        cpu_text = pct(cpu["median"]) if cpu else "—"
        lines.append(f"{head}| {ms} | {pct(ov['median'])} | {spread(ov)} | {iqr(ov)} | "
                     f"{cpu_text} | {verdict} |")
    return "\n".join(lines)


def floor_table(group: dict) -> str:
    floors = [r for r in group["rows"] if r["role"] == "floor" and r["status"] == "ok"]
    if not floors:
        return ""
    lines = ["| path | fixed cost per step (ms, median) | share of the plain step (median) |",
             "|---|---:|---:|"]
    for row in sorted(floors, key=lambda r: PATH_ORDER.index(r["path"])):
        share = 100.0 * row["vs_baseline"]["median"]
        lines.append(f"| {row['path']} | {row['ms_per_micro_batch']['median']:.2f} | "
                     f"{share:.1f} % |")
    return "\n".join(lines)


def _functions(text_of, graph: dict) -> str:
    if list(graph) == ["step"]:
        return text_of(graph["step"])
    return ", ".join(f"{name}: {text_of(value)}" for name, value in graph.items())


def all_reduce_table(group: dict) -> str:
    k = group["k"]
    lines = [
        (f"| approach | path | graph: all-reduces per call (every call / inside `tf.cond`) | "
        f"calls per update (k = {k} micro-batches) | derived per update | "
        "measured per update (profiler) |"),
        "|---|---|---|---|---:|---:|",
    ]
    for row in ordered_rows(group):
        head = f"| {row_name(row)} | {row['path']} "
        if row["status"] != "ok":
            lines.append(f"{head}| did not run: {cell(short_error(row, 90))} | | | |")
            continue
        record = row.get("all_reduces") or {}
        if "error" in record:
            lines.append(f"{head}| counting failed: {cell(record['error'])} | | | |")
            continue
        graph = _functions(lambda p: f"{p['every_call']} / {p['conditional']}",
                           record.get("graph", {}))
        calls = _functions(
            lambda c: f"{c['calls']:g}" + (f" (branch taken {c['branch_runs']:g})"
                                           if c["branch_runs"] else ""),
            record.get("calls_per_update", {}))
        lines.append(f"{head}| {graph} | {calls} | {record.get('derived_per_update', 0):g} | "
                     f"{record.get('measured_per_update', 0):g} |")
    return "\n".join(lines)


def memory_table(group: dict) -> str:
    device = next((r["memory"]["device"] for r in group["rows"] if r.get("memory")), "?")
    lines = [
        (f"| approach | path | allocator peak above live tensors, one update ({device}, MiB) | "
        "persistent buffers per replica (MiB) |"),
        "|---|---|---:|---:|",
    ]
    for row in ordered_rows(group):
        if row["status"] != "ok" or not row.get("memory"):
            continue
        memory = row["memory"]
        lines.append(f"| {row_name(row)} | {row['path']} | {memory['step_bytes'] / MIB:.1f} | "
                     f"{memory['state_bytes_per_replica'] / MIB:.2f} |")
    return "\n".join(lines)


FRESH_TITLES = {
    "micro_batching": "MicroBatching, batch B in k micro-batches",
    "plain_micro_batch": "plain step on B/k",
    "plain_big_batch": "plain step on B",
}


def fresh_table(results: dict) -> str:
    fresh = results.get("fresh_process_memory") or []
    if not fresh:
        return ""
    lines = [("| configuration | batch | micro-batches | peak RSS (MiB) | RSS growth during the "
             "first fit (MiB) | allocator peak above live tensors (MiB) |"),
             "|---|---:|---:|---:|---:|---:|"]
    for item in fresh:
        lines.append(f"| {FRESH_TITLES.get(item['config'], item['config'])} | "
                     f"{item['batch_size']} | {item['micro_batches']} | "
                     f"{item['rss_peak'] / MIB:.0f} | {item['rss_growth'] / MIB:.0f} | "
                     f"{item['allocator_step_bytes'] / MIB:.1f} |")
    return "\n".join(lines)


def _scaling_points(results: dict) -> dict:
    """`{(strategy, k): group}` of every group that has our approaches."""
    points = {}
    for group in results.get("groups", []):
        points[(group["strategy"], group["k"])] = group
    return points


def _ours_and_baselines(group: dict) -> list:
    return [r for r in ordered_rows(group, ("baseline", "approach"))
            if r.get("ours") or r["role"] == "baseline"]


def _ok(group, key):
    row = next((r for r in group["rows"] if r["key"] == key), None) if group else None
    return row if row and row["status"] == "ok" else None


def scaling_k_table(results: dict) -> str:
    distributed = f"R{results['replicas']}"
    points = _scaling_points(results)
    ks = [k for k in results["ks"] if (distributed, k) in points]
    if not ks:
        return ""
    reference = points[(distributed, ks[-1])]
    lines = ["| approach | path | " + " | ".join(f"k = {k}" for k in ks) + " |",
             "|---|---|" + "---:|" * len(ks)]
    for proto in _ours_and_baselines(reference):
        if proto["role"] == "baseline":
            continue
        cells = []
        for k in ks:
            row = _ok(points[(distributed, k)], proto["key"])
            cells.append(f"{pct(row['overhead_percent']['median'])} ({spread(row['overhead_percent'])})"
                         if row else "—")
        lines.append(f"| {row_name(proto)} | {proto['path']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("All-reduces per update, measured (profiler):")
    lines.append("")
    lines.append("| approach | path | " + " | ".join(f"k = {k}" for k in ks) + " |")
    lines.append("|---|---|" + "---:|" * len(ks))
    for proto in _ours_and_baselines(reference):
        cells = []
        for k in ks:
            row = _ok(points[(distributed, k)], proto["key"])
            value = (row.get("all_reduces") or {}).get("measured_per_update") if row else None
            cells.append("—" if value is None else f"{value:g}")
        lines.append(f"| {row_name(proto)} | {proto['path']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling_replicas_table(results: dict) -> str:
    points = _scaling_points(results)
    k = results["k"]
    strategies = [s for s in ("none", "R1", f"R{results['replicas']}") if (s, k) in points]
    if len(strategies) < 2:
        return ""
    reference = points[(strategies[-1], k)]
    lines = ["| approach | path | " + " | ".join(strategy_title(s) for s in strategies) + " |",
             "|---|---|" + "---:|" * len(strategies)]
    loads = [f"{points[(s, k)]['load_average_at_start'][0]:.1f}" for s in strategies]
    lines.append("| *1-minute load average when the group started* | | " + " | ".join(loads) + " |")
    for proto in _ours_and_baselines(reference):
        cells = []
        for strategy in strategies:
            row = _ok(points[(strategy, k)], proto["key"])
            if row is None:
                cells.append("—")
            elif proto["role"] == "baseline":
                cells.append(f"{row['ms_per_micro_batch']['median']:.2f} ms")
            else:
                cells.append(f"{pct(row['overhead_percent']['median'])} "
                             f"({spread(row['overhead_percent'])})")
        lines.append(f"| {row_name(proto)} | {proto['path']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(results: dict) -> str:
    """Which of our approaches meet the target, group by group (computed)."""
    sentences = []
    for group in groups_of(results, "main"):
        ours = [r for r in group["rows"] if r.get("ours") and r["status"] == "ok"]
        met = [r for r in ours if r["overhead_percent"]["median"] <= TARGET_PERCENT]
        missed = [r for r in ours if r["overhead_percent"]["median"] > TARGET_PERCENT]
        text = f"{strategy_title(group['strategy'])}, k = {group['k']}: "
        def cpu_of(r):
            cpu = r.get("cpu_overhead_percent")
            return f", CPU time {pct(cpu['median'])}" if cpu else ""

        if met:
            text += "within the target: " + ", ".join(
                f"{r['label']} ({r['path']}, {pct(r['overhead_percent']['median'])}{cpu_of(r)})"
                for r in met)
        if missed:
            text += ("; " if met else "") + "**above the target**: " + ", ".join(
                f"{r['label']} ({r['path']}, {pct(r['overhead_percent']['median'])}, spread "
                f"{spread(r['overhead_percent'])}{cpu_of(r)})" for r in missed)
        sentences.append(f"* {text}.")
    return "\n".join(sentences)


def results_markdown(results: dict) -> str:
    """Every table of one results file (the content of results.md)."""
    parts = [f"# Benchmark results ({results['label'].upper()})", "", environment_line(results),
             ""]
    for group in groups_of(results, "main"):
        parts += [f"## Overhead: {strategy_title(group['strategy'])}, k = {group['k']}", "",
                  overhead_table(group), ""]
        floor = floor_table(group)
        if floor:
            parts += ["Fixed cost per step (a model with one hidden unit, same data):", "",
                      floor, ""]
    distributed = main_group(results)
    if distributed:
        parts += [f"## All-reduces per update: {strategy_title(distributed['strategy'])}", "",
                  all_reduce_table(distributed), "",
                  f"## Memory: {strategy_title(distributed['strategy'])}", "",
                  memory_table(distributed), ""]
    fresh = fresh_table(results)
    if fresh:
        parts += ["## Peak RSS, one fresh process per configuration", "", fresh, ""]
    scaling = scaling_k_table(results)
    if scaling:
        parts += [f"## Scaling in k ({strategy_title('R' + str(results['replicas']))})", "",
                  "Overhead vs the plain micro-batch step, median (min … max):", "", scaling, ""]
    replicas = scaling_replicas_table(results)
    if replicas:
        parts += [f"## Scaling in replicas (k = {results['k']})", "",
                  "Baselines: ms per micro-batch; approaches: overhead, median (min … max).", "",
                  replicas, ""]
    return "\n".join(parts).rstrip() + "\n"


def environment_line(results: dict) -> str:
    env, machine, sizes = results["environment"], results["machine"], results["sizes"]
    devices = ", ".join(d.rsplit("/", 1)[-1] for d in env.get("devices", []))
    gpus = env.get("physical_gpus") or []
    load_start = machine["load_average_start"][0]
    load_end = machine["load_average_end"][0]
    return (
        f"Run of {results['started']} (`{results['command']}`, {results['wall_seconds']:.0f} s, "
        f"on top of commit {results.get('git_commit') or '?'}): TensorFlow {env['tensorflow']}, Keras "
        f"{env['keras']}, Python {env['python']}; {machine['cpu_count']} CPU cores"
        + (f", {len(gpus)} GPU(s)" if gpus else ", no GPU")
        + f"; replicas on {devices} ({env.get('cross_device_ops', '?')}); 1-minute load average "
        f"{load_start:.1f} at the start, {load_end:.1f} at the end. Model: {sizes['features']} "
        f"inputs, {sizes['layers']} × Dense({sizes['hidden']}, tanh), Dense(1), float32, "
        f"{results['optimizer']}, `jit_compile=False`; micro-batch {sizes['micro_batch']} "
        f"examples (global); {sizes['micro_batches_per_block']} micro-batches per timed block; "
        f"{sizes['repeats']} rounds (main), {sizes['scaling_repeats']} (scaling)."
    )


# --- plots ---------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


OURS_COLOR, OTHER_COLOR, REFERENCE_COLOR = "#1f77b4", "#ff7f0e", "#7f7f7f"


def plot_overhead(results: dict, path: Path) -> Path | None:
    groups = groups_of(results, "main")
    if not groups:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.8), squeeze=False)
    for ax, group in zip(axes[0], groups):
        rows = [r for r in ordered_rows(group, ("approach", "reference")) if r["status"] == "ok"]
        labels, medians, low, high, colors = [], [], [], [], []
        for row in rows:
            ov = row["overhead_percent"]
            labels.append(f"{row['label']} ({row['path']})")
            medians.append(ov["median"])
            low.append(ov["median"] - ov["min"])
            high.append(ov["max"] - ov["median"])
            colors.append(OURS_COLOR if row.get("ours") else
                          REFERENCE_COLOR if row["role"] == "reference" else OTHER_COLOR)
        y = list(range(len(rows)))[::-1]
        ax.barh(y, medians, xerr=[low, high], color=colors, capsize=3)
        ax.set_yticks(y, labels, fontsize=8)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.axvline(TARGET_PERCENT, color="green", linestyle="--", linewidth=0.8,
                   label=f"+{TARGET_PERCENT:g} % target")
        ax.set_xlabel("overhead vs plain step (%), median and min…max")
        ax.set_title(f"{strategy_title(group['strategy'])}, k = {group['k']}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("blue: distgrad · orange: others · grey: plain step on the whole batch",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scaling(results: dict, path: Path) -> Path | None:
    distributed = f"R{results['replicas']}"
    points = _scaling_points(results)
    ks = [k for k in results["ks"] if (distributed, k) in points]
    strategies = [s for s in ("none", "R1", distributed) if (s, results["k"]) in points]
    if not ks:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    reference = points[(distributed, ks[-1])]
    ours = [r for r in _ours_and_baselines(reference) if r.get("ours")]
    for proto in ours:
        rows = [_ok(points[(distributed, k)], proto["key"]) for k in ks]
        xs = [k for k, r in zip(ks, rows) if r]
        med = [r["overhead_percent"]["median"] for r in rows if r]
        lo = [r["overhead_percent"]["min"] for r in rows if r]
        hi = [r["overhead_percent"]["max"] for r in rows if r]
        line, = axes[0].plot(xs, med, marker="o", label=f"{proto['label']} ({proto['path']})")
        axes[0].fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
    axes[0].axhline(0, color="black", linewidth=0.8)
    axes[0].axhline(TARGET_PERCENT, color="green", linestyle="--", linewidth=0.8)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(ks, [str(k) for k in ks])
    axes[0].set_xlabel("k (micro-batches per update)")
    axes[0].set_ylabel("overhead (%), median and min…max")
    axes[0].set_title(f"overhead vs k, {strategy_title(distributed)}", fontsize=10)
    axes[0].legend(fontsize=7)
    for proto in _ours_and_baselines(reference):
        rows = [_ok(points[(distributed, k)], proto["key"]) for k in ks]
        pairs = [(k, (r.get("all_reduces") or {}).get("measured_per_update"))
                 for k, r in zip(ks, rows) if r]
        pairs = [(k, v) for k, v in pairs if v is not None]
        if pairs:
            style = "--" if proto["role"] == "baseline" else "-"
            axes[1].plot([p[0] for p in pairs], [p[1] for p in pairs], style, marker="o",
                         label=f"{proto['label']} ({proto['path']})")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(ks, [str(k) for k in ks])
    axes[1].set_xlabel("k")
    axes[1].set_ylabel("all-reduces per update (profiler)")
    axes[1].set_title("all-reduces per update: plain k, ours 1", fontsize=10)
    axes[1].legend(fontsize=7)
    width = 0.8 / max(1, len(ours))
    for i, proto in enumerate(ours):
        values = []
        for strategy in strategies:
            row = _ok(points[(strategy, results["k"])], proto["key"])
            values.append(row["overhead_percent"]["median"] if row else float("nan"))
        axes[2].bar([j + i * width for j in range(len(strategies))], values, width,
                    label=f"{proto['label']} ({proto['path']})")
    axes[2].set_xticks([j + width * (len(ours) - 1) / 2 for j in range(len(strategies))],
                       [strategy_title(s).replace("MirroredStrategy, ", "Mirrored\n")
                        for s in strategies], fontsize=8)
    axes[2].axhline(0, color="black", linewidth=0.8)
    axes[2].axhline(TARGET_PERCENT, color="green", linestyle="--", linewidth=0.8)
    axes[2].set_ylabel("overhead (%), median")
    axes[2].set_title(f"overhead vs replicas, k = {results['k']}", fontsize=10)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(results: dict, path: Path) -> Path | None:
    group = main_group(results)
    fresh = results.get("fresh_process_memory") or []
    if group is None and not fresh:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    if group is not None:
        rows = [r for r in ordered_rows(group) if r["status"] == "ok" and r.get("memory")]
        y = list(range(len(rows)))[::-1]
        step = [r["memory"]["step_bytes"] / MIB for r in rows]
        state = [r["memory"]["state_bytes_per_replica"] * group["replicas"] / MIB for r in rows]
        axes[0].barh(y, step, color=OURS_COLOR, label="allocator peak above live tensors")
        axes[0].barh(y, state, left=step, color=OTHER_COLOR,
                     label="persistent buffers (all replicas)")
        axes[0].set_yticks(y, [f"{r['label']} ({r['path']})" for r in rows], fontsize=8)
        axes[0].set_xlabel("MiB")
        axes[0].set_title(f"one update, {strategy_title(group['strategy'])}, k = {group['k']}",
                          fontsize=10)
        axes[0].legend(fontsize=8, loc="lower right")
    if fresh:
        names = [FRESH_TITLES.get(f["config"], f["config"]) for f in fresh]
        x = list(range(len(fresh)))
        axes[1].bar([i - 0.2 for i in x], [f["rss_growth"] / MIB for f in fresh], 0.4,
                    label="RSS growth during the first fit")
        axes[1].bar([i + 0.2 for i in x], [f["allocator_step_bytes"] / MIB for f in fresh], 0.4,
                    label="allocator peak above live tensors")
        axes[1].set_xticks(x, names, fontsize=8)
        axes[1].set_ylabel("MiB")
        axes[1].set_title("fresh process per configuration", fontsize=10)
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    tail = suffix(results["label"])
    made = [plot_overhead(results, out_dir / f"overhead{tail}.png"),
            plot_scaling(results, out_dir / f"scaling{tail}.png"),
            plot_memory(results, out_dir / f"memory{tail}.png")]
    return [p for p in made if p is not None]


# --- the page ------------------------------------------------------------------------


def _image(page_dir: Path, path: Path, alt: str) -> str:
    return f"![{alt}]({Path(os.path.relpath(path, page_dir)).as_posix()})"


def _link(page_dir: Path, path: Path) -> str:
    return Path(os.path.relpath(path, page_dir)).as_posix()


def _pypi_paragraph(results: dict) -> str:
    pypi = results.get("pypi_package") or {}
    if not pypi.get("version"):
        return ("The PyPI package `gradient-accumulator` was **not installed** for this run "
                "(`pip install -e '.[bench]'`), so its rows say so.")
    text = f"PyPI `gradient-accumulator` {pypi['version']} was installed. "
    if pypi.get("import_error"):
        error = pypi["import_error"]
        return text + f"Importing it failed: `{error['type']}`: {cell(error['message'][:200])}."
    optimizer = pypi.get("optimizer_error")
    if optimizer:
        text += ("Its `GradientAccumulateOptimizer` cannot be created on Keras 3 "
                 f"(`{optimizer['type']}`: {cell(' '.join(optimizer['message'].split())[:160])} …); "
                 "its `GradientAccumulateModel` is what the rows measure.")
    return text


def did_not_run(results: dict) -> str:
    """Which approaches failed where, computed from the rows, with the known causes."""
    none, distributed = main_group(results, "none"), main_group(results)
    lines = []
    if none and distributed:
        for row in distributed["rows"]:
            if row["status"] == "ok" or row["role"] == "floor":
                continue
            alone = _ok(none, row["key"])
            where = ("runs without a strategy but not under "
                     f"{strategy_title(distributed['strategy'])}" if alone else
                     "does not run here")
            lines.append(f"* {row['label']} ({row['path']}) {where}: "
                         f"{cell(short_error(row, 200))}")
    text = "\n".join(lines) or "Every approach ran in every configuration."
    text += ("\n\nKeras' built-in `gradient_accumulation_steps` and the PyPI package's "
             "`GradientAccumulateModel.train_step` call `optimizer.apply_gradients` inside a "
             "`tf.cond` in replica context; under `MirroredStrategy` that `merge_call` in a cond "
             "branch raises (lesson 03, `distgrad.pitfalls.cond_merge_call`). Upstream: "
             "keras-team/keras#20582 (open) for the built-in, andreped/GradientAccumulator#5 "
             "for the package's missing multi-GPU support. " + _pypi_paragraph(results))
    return text


def _section(results: dict, out_dir: Path, page_dir: Path, level: str) -> list[str]:
    """The measured sections of one results file, headings at `level` (## or ###)."""
    tail = suffix(results["label"])
    sub = level + "#"
    parts = [environment_line(results), ""]
    parts += [f"{level} 1. Step-time overhead", ""]
    parts += [("Time per micro-batch of each approach divided by the plain micro-batch step's "
              "time (same path, same round), minus one. A negative overhead means the approach "
              "was faster than one optimizer step per micro-batch: it skips k − 1 optimizer "
              "updates and all-reduces (and, in `train_step`, k − 1 train-function calls)."), ""]
    parts += [verdict(results), ""]
    for group in groups_of(results, "main"):
        parts += [f"{sub} {strategy_title(group['strategy'])}, k = {group['k']}", "",
                  overhead_table(group), ""]
        floor = floor_table(group)
        if floor:
            parts += [("The fixed cost of one step, measured with the same data on a model with "
                      "one hidden unit (how much of a step is not compute):"), "", floor, ""]
    overhead_png = out_dir / f"overhead{tail}.png"
    if overhead_png.is_file():
        parts += [_image(page_dir, overhead_png, "Overhead of each approach"), ""]
    distributed = main_group(results)
    if distributed:
        parts += [f"{level} 2. All-reduces per update", "",
                  (f"One accumulated update = k = {distributed['k']} micro-batches, "
                  f"{strategy_title(distributed['strategy'])}. *Graph*: all-reduce ops in each "
                  "traced function (per replica), split into those that run on every call and "
                  "those inside a `tf.cond` branch. *Derived*: graph counts × how often each "
                  "function ran (calls counted by the runner) and how often the branch was taken "
                  "(the wrapped optimizer's `iterations`, i.e. updates made). *Measured*: "
                  "all-reduce kernels executed in a TensorFlow profiler trace of one update, "
                  "divided by the replica count (the host tracer rarely drops an event; a "
                  "count that is not a multiple of the replica count is retaken, and the JSON "
                  "records how many traces it took)."), "", all_reduce_table(distributed), ""]
    scaling_png = out_dir / f"scaling{tail}.png"
    if distributed:
        parts += [f"{level} 3. Peak memory", "",
                  ("*Allocator*: `tf.config.experimental.get_memory_info` peak during one update "
                  "minus the bytes live before it (`distgrad.memory.measure_step_memory`; on "
                  "CPU every logical device shares one allocator, so it is all replicas "
                  "together; it ignores tensors under 256 KiB). *Persistent buffers*: the "
                  "accumulators (and counters) the approach keeps between updates, per replica."),
                  "", memory_table(distributed), ""]
        fresh = fresh_table(results)
        if fresh:
            parts += [("Micro-batch B/k with accumulation vs plain B/k vs plain B, each in a "
                      "fresh process (`python -m distgrad.memory`, the measurement of "
                      "`distgrad.memory.fresh_process_step_memory`: the same MLP as a "
                      "`MicroBatchingModel`, one fit step). Peak RSS is a lifetime maximum, "
                      "so each configuration gets its own process, started through a tiny "
                      "trampoline process: a child started directly from the benchmark's "
                      "large process would report the *benchmark's* peak as its own (Linux "
                      "carries the pre-exec high-water mark into `ru_maxrss`)."), "", fresh, ""]
        memory_png = out_dir / f"memory{tail}.png"
        if memory_png.is_file():
            parts += [_image(page_dir, memory_png, "Memory of one update"), ""]
    scaling = scaling_k_table(results)
    replicas = scaling_replicas_table(results)
    if scaling or replicas:
        parts += [f"{level} 4. Scaling", ""]
        if scaling:
            parts += [f"{sub} In k ({strategy_title('R' + str(results['replicas']))})", "",
                      ("Overhead vs the plain micro-batch step, median (min … max); the micro-batch "
                      "size is fixed, so a larger k means a larger effective batch. At k = 1 "
                      "nothing is saved (one update and one all-reduce per micro-batch, as in the "
                      "plain step), so that column is the accumulation mechanism's own cost; "
                      "from k = 2 on, the skipped updates and all-reduces pay for it."), "",
                      scaling, ""]
        if replicas:
            parts += [f"{sub} In replicas (k = {results['k']})", "",
                      ("The global micro-batch is fixed: more replicas split it. Baselines in ms "
                      "per micro-batch, approaches as overhead, median (min … max). Each column "
                      "was timed in its own group, at its own moment of the machine's load: "
                      "compare the overheads (paired within a group), not the milliseconds "
                      "across columns."), "",
                      replicas, ""]
        if scaling_png.is_file():
            parts += [_image(page_dir, scaling_png, "Scaling in k and in replicas"), ""]
    return parts


INTRO = """# Performance

What gradient accumulation costs, measured: step time against the plain micro-batch step,
all-reduces per update, and memory, for every approach of the lessons — `distgrad`'s
`GradientAccumulator` (custom loop), `AccumulatingOptimizer` (fit and custom loop) and
`MicroBatching` (`train_step`, fit) — next to Keras' built-in
`gradient_accumulation_steps`, the 0/1 mask trick and the PyPI `gradient-accumulator`
package. Every number below was written by `benchmarks/run.py` into
[`results.json`]({json_link}) (all tables: [results.md]({md_link})); nothing here is typed
by hand.

!!! warning "A shared 2-core CPU machine"
    The CPU figures come from 2 CPU cores that other work was using at the same time (the
    load averages are recorded with each run). Logical CPU replicas share those cores, so
    more replicas add synchronization, not compute, and an all-reduce between them is a
    memory copy. Runs are interleaved and paired to cancel the load's drift, but single
    rounds still vary by several percent: read the medians with their spread.

## How it is measured

* **Same work for everyone.** One MLP, the same data, SGD, float32, `jit_compile=False`.
  An *update* is k micro-batches of a fixed size. The *plain micro-batch step* (one
  optimizer update per micro-batch) is the baseline of its path: `model.fit`'s step for the
  fit approaches, `strategy.run(replica_step)` in a `tf.function` for the custom loops.
  "plain step on the whole batch B" is one step on all k micro-batches at once (no
  accumulation, k times the activations): a reference, not an approach.
* **Fit without fit's overhead.** Each fit model is first trained with `model.fit` (so it
  demonstrably runs there); the timing then calls `model.train_function`, the function fit
  calls once per step, on batches distributed once beforehand, like the custom loops. Fit's
  per-call setup and callbacks are not in the numbers.
* **Paired, interleaved rounds.** In each round every runner trains the same number of
  micro-batches, in an order rotated by one each round; each approach is divided by its
  baseline *of the same round*. Reported: median, min … max and quartiles of those ratios.
  Python's garbage collector is paused inside a timed block. Next to wall time, each block's
  process CPU time is compared the same way: another process' load stretches wall time
  (waiting for a core) more than it changes the work done.
* **Compute-bound sizes.** The fixed cost of a step (the same step on a model with one hidden
  unit) is reported next to each table, so you can see that the step time is mostly compute.

Run it yourself: `make bench` (or `.venv/bin/python -m benchmarks.run`; `--quick` for a
seconds-long smoke run, `--help` for options). The PyPI package is an optional extra:
`pip install -e '.[bench]'`.
"""

GPU_PLACEHOLDER = """No GPU figures have been measured yet. On a machine with NVIDIA GPUs
([GPU guide](guides/gpu.md)), run

```bash
bash benchmarks/gpu.sh
```

It runs the same benchmark on GPU replicas (a larger model, `--preset gpu`; GPU memory from
`tf.config.experimental.get_memory_info("GPU:0")`), writes `docs/performance/results-gpu.json`
and re-renders this page, which then shows the measured GPU tables here. Until then this
section stays empty on purpose: CPU numbers say little about GPU overheads, and no figure on
this page is estimated."""


def render_page(found: dict, out_dir: Path, page_path: Path) -> str:
    page_dir = page_path.parent
    json_path = results_file(out_dir, "cpu") if "cpu" in found else \
        results_file(out_dir, next(iter(found)))
    md_name = "results.md" if "cpu" in found else f"results-{next(iter(found))}.md"
    parts = [INTRO.format(json_link=_link(page_dir, json_path),
                          md_link=_link(page_dir, out_dir / md_name)).rstrip(), ""]
    cpu = found.get("cpu")
    if cpu:
        parts += ["## CPU results", ""]
        parts += _section(cpu, out_dir, page_dir, "###")
        parts += ["### About the approaches that did not run", "", did_not_run(cpu), ""]
    parts += ["## GPU results", ""]
    gpu = found.get("gpu")
    if gpu:
        parts += _section(gpu, out_dir, page_dir, "###")
    else:
        parts += [GPU_PLACEHOLDER, ""]
    parts += ["## Reproduce", "",
              "```bash",
              "make bench                                   # = .venv/bin/python -m benchmarks.run",
              ".venv/bin/python -m benchmarks.run --quick   # smoke size, writes benchmarks/results/quick/",
              ".venv/bin/python -m benchmarks.run --report-only  # re-render this page from the JSON",
              "bash benchmarks/gpu.sh                       # on a GPU machine",
              "```", ""]
    return "\n".join(parts).rstrip() + "\n"


def render_all(out_dir: Path, page_path: Path) -> list[Path]:
    """Write results*.md, the plots and the page from the JSON files in `out_dir`."""
    out_dir, page_path = Path(out_dir), Path(page_path)
    found = load_results(out_dir)
    if not found:
        raise FileNotFoundError(f"no results.json or results-gpu.json in {out_dir}: run "
                                "`python -m benchmarks.run` first.")
    written = []
    for label, results in found.items():
        md = out_dir / ("results.md" if label == "cpu" else f"results-{label}.md")
        md.write_text(results_markdown(results), encoding="utf-8")
        written.append(md)
        written += write_plots(results, out_dir)
    page_path.parent.mkdir(parents=True, exist_ok=True)
    page_path.write_text(render_page(found, out_dir, page_path), encoding="utf-8")
    written.append(page_path)
    return written
