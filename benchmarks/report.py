"""Turn `results*.json` into the markdown tables and plots of the Performance page.

The page, `docs/performance.md`, is hand-written: it explains what each table measures
and includes the tables this module writes next to the JSON (pymdownx.snippets,
`--8<-- "performance/<name>.md"`). Every number comes from a results file; the only
judgement made here is the verdict on the 3 % target, which needs rounds that agree:
when the middle half of a row's paired rounds spreads over more than the target, the
cell says "not resolvable on this machine" instead of yes or no.

Written for the CPU results (`results.json`): one file per name in `TITLES`. For
the GPU results (`results-gpu.json`) all tables go into `gpu.md`, under headings; it
holds a placeholder until a GPU run exists. Links in the files are relative to OUT's
parent folder, where the page is.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.rows import (
    FRESH_TITLES,
    MIB,
    PATH_ORDER,
    TARGET_PERCENT,
    groups_of,
    kernel_share,
    load_results,
    main_group,
    ok_row,
    ordered_rows,
    ours_and_baselines,
    pct,
    points,
    spread,
    strategy_title,
)

NOT_RESOLVABLE = "not resolvable on this machine"
NOT_RECORDED = ("*Not in this results file: it was written before the benchmark traced "
                "op time. The next `make bench` records it.*")
# The files, in page order, and their headings in gpu.md.
TITLES = {
    "run": "The run", "overhead-one-device": "Step-time overhead, no strategy",
    "overhead-distributed": "Step-time overhead, MirroredStrategy",
    "floor": "Fixed cost per step", "kernels": "The accumulation's own kernels",
    "all-reduces": "All-reduces per update", "memory": "Memory of one update",
    "fresh-processes": "Peak RSS, one fresh process per configuration",
    "scaling-k": "Scaling in k: overhead",
    "scaling-k-kernels": "Scaling in k: accumulation kernels, share of op time",
    "scaling-k-all-reduces": "Scaling in k: all-reduces per update (profiler)",
    "scaling-replicas": "Scaling in replicas",
}
GPU_PLACEHOLDER = """No GPU figures have been measured yet. On a machine with NVIDIA GPUs
([GPU guide](guides/gpu.md)), `bash benchmarks/gpu.sh` runs the same benchmark on GPU
replicas (a larger model, `--preset gpu`), writes `docs/performance/results-gpu.json` and
fills this section. Until then it stays empty on purpose: CPU numbers say little about
GPU overheads, and no figure on this page is estimated.
"""


# --- formatting ---------------------------------------------------------------------


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def short_error(row: dict, limit: int = 150) -> str:
    """One line saying why a row did not run."""
    if row.get("reason"):
        return row["reason"]
    error = row.get("error") or {}
    message = " ".join(error.get("message", "").split())  # colour codes: stripped by run
    if len(message) > limit:
        message = message[:limit].rstrip() + " …"
    return f"`{error.get('type', 'Error')}`: {message}"


def row_name(row: dict) -> str:
    return f"**{row['label']}** (distgrad)" if row.get("ours") else row["label"]


def table(header: list[str], align: str, lines: list[str]) -> str:
    """A markdown table: `align` has one character per column, `l` or `r`."""
    rule = "|".join("---:" if a == "r" else "---" for a in align)
    return "\n".join([f"| {' | '.join(header)} |", f"|{rule}|", *lines])


def line(row: dict, cells: list) -> str:
    return "| " + " | ".join([row_name(row), row["path"], *map(str, cells)]) + " |"


def caption(group: dict, timed: bool = False) -> str:
    rounds = f", {group['repeats']} rounds" if timed else ""
    return f"*{strategy_title(group['strategy'])}, k = {group['k']}{rounds}.*"


# --- judgements ---------------------------------------------------------------------


def verdict(row: dict) -> str:
    """≤ target: yes / no for our approaches, or `NOT_RESOLVABLE` when the quartiles of
    the paired rounds are further apart than the target."""
    if row["role"] == "reference":
        return "(reference)"
    if not row.get("ours"):
        return ""
    overhead = row["overhead_percent"]
    if overhead["q3"] - overhead["q1"] > TARGET_PERCENT:
        return NOT_RESOLVABLE
    return "yes" if overhead["median"] <= TARGET_PERCENT else "no"


def share_text(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} %"


# --- tables ---------------------------------------------------------------------------


def overhead_table(group: dict) -> str:
    lines = []
    for row in ordered_rows(group):
        if row["status"] != "ok":
            lines.append(line(row, [f"did not run: {cell(short_error(row))}"] + [""] * 6))
            continue
        ms = f"{row['ms_per_micro_batch']['median']:.2f}"
        share = share_text(kernel_share(row))
        if row["role"] == "baseline":
            lines.append(line(row, [ms, "baseline", "", "", "", "", share]))
            continue
        ov, cpu = row["overhead_percent"], row.get("cpu_overhead_percent")
        lines.append(line(row, [ms, pct(ov["median"]), spread(ov), spread(ov, "q1", "q3"),
                                pct(cpu["median"]) if cpu else "—", verdict(row), share]))
    header = ["approach", "path", "ms per micro-batch (median)",
              "overhead vs plain micro-batch step (median)", "min … max", "quartiles",
              "by CPU time (median)", f"≤ {TARGET_PERCENT:g} %",
              "accumulation kernels, share of op time"]
    return caption(group, timed=True) + "\n\n" + table(header, "llrrrrrlr", lines)


def floor_table(results: dict) -> str:
    lines = []
    for group in groups_of(results, "main"):
        floors = [r for r in group["rows"] if r["role"] == "floor" and r["status"] == "ok"]
        for row in sorted(floors, key=lambda r: PATH_ORDER.index(r["path"])):
            lines.append(f"| {strategy_title(group['strategy'])} | {row['path']} | "
                         f"{row['ms_per_micro_batch']['median']:.2f} | "
                         f"{100.0 * row['vs_baseline']['median']:.1f} % |")
    if not lines:
        return "*No floor runners in this run (the quick preset leaves them out).*"
    return table(["strategy", "path", "fixed cost per step (ms, median)",
                  "share of the plain step (median)"], "llrr", lines)


def kernels_table(results: dict) -> str:
    parts = []
    for group in filter(None, (main_group(results, False), main_group(results))):
        traced = [r for r in ordered_rows(group) if r.get("op_time")]
        if traced:  # categories in `benchmarks.trace.CATEGORIES` order, as recorded
            categories = list(traced[0]["op_time"]["percent"])
            lines = [line(r, [f"{r['op_time']['percent'][c]:.2f} %" for c in categories]
                          + [f"{r['op_time']['total_us'] / 1e3:.2f}"]) for r in traced]
            header = ["approach", "path", *categories, "op time per update (ms)"]
            parts.append(caption(group) + "\n\n" + table(header, "ll" + "r" * len(header[2:]),
                                                           lines))
    return "\n\n".join(parts) or NOT_RECORDED


def _per_call(text_of, per_function: dict) -> str:
    if list(per_function) == ["step"]:
        return text_of(per_function["step"])
    return ", ".join(f"{name}: {text_of(value)}" for name, value in per_function.items())


def all_reduce_table(group: dict) -> str:
    lines = []
    for row in ordered_rows(group):
        record = row.get("all_reduces") or {}
        if row["status"] != "ok" or "error" in record:
            why = (f"did not run: {cell(short_error(row, 90))}" if row["status"] != "ok"
                   else f"counting failed: {cell(record['error'])}")
            lines.append(line(row, [why, "", "", ""]))
            continue
        graph = _per_call(lambda p: f"{p['every_call']} / {p['conditional']}",
                          record.get("graph", {}))
        calls = _per_call(lambda c: f"{c['calls']:g}" + (
            f" (branch taken {c['branch_runs']:g})" if c["branch_runs"] else ""),
            record.get("calls_per_update", {}))
        lines.append(line(row, [graph, calls, f"{record.get('derived_per_update', 0):g}",
                                f"{record.get('measured_per_update', 0):g}"]))
    header = ["approach", "path", "graph: all-reduces per call (every call / inside `tf.cond`)",
              f"calls per update (k = {group['k']} micro-batches)", "derived per update",
              "measured per update (profiler)"]
    return caption(group) + "\n\n" + table(header, "llllrr", lines)


def memory_table(group: dict) -> str:
    device = next((r["memory"]["device"] for r in group["rows"] if r.get("memory")), "?")
    lines = [line(r, [f"{r['memory']['step_bytes'] / MIB:.1f}",
                      f"{r['memory']['state_bytes_per_replica'] / MIB:.2f}"])
             for r in ordered_rows(group) if r["status"] == "ok" and r.get("memory")]
    header = ["approach", "path", f"allocator peak above live tensors, one update ({device}, MiB)",
              "persistent buffers per replica (MiB)"]
    return caption(group) + "\n\n" + table(header, "llrr", lines)


def fresh_table(results: dict) -> str:
    lines = [f"| {FRESH_TITLES.get(f['config'], f['config'])} | {f['batch_size']} | "
             f"{f['micro_batches']} | {f['rss_peak'] / MIB:.0f} | {f['rss_growth'] / MIB:.0f} | "
             f"{f['allocator_step_bytes'] / MIB:.1f} |"
             for f in results.get("fresh_process_memory") or []]
    header = ["configuration", "batch", "micro-batches", "peak RSS (MiB)",
              "RSS growth during the first fit (MiB)", "allocator peak above live tensors (MiB)"]
    return table(header, "lrrrrr", lines) if lines else "*Not measured in this run.*"


def _overhead_cell(row) -> str:
    return f"{pct(row['overhead_percent']['median'])} ({spread(row['overhead_percent'])})"


def _measured_cell(row) -> str:
    value = (row.get("all_reduces") or {}).get("measured_per_update")
    return "—" if value is None else f"{value:g}"


def per_k_table(results: dict, cell_of, with_baselines: bool) -> str:
    """One row per approach, one column per k (distributed groups); `cell_of(row)`."""
    distributed = f"R{results['replicas']}"
    found = points(results)
    ks = [k for k in results["ks"] if (distributed, k) in found]
    if not ks:
        return "*No scaling in k in this run.*"
    lines = []
    for proto in ours_and_baselines(found[(distributed, ks[-1])]):
        if with_baselines or proto["role"] != "baseline":
            rows = [ok_row(found[(distributed, k)], proto["key"]) for k in ks]
            lines.append(line(proto, [cell_of(r) if r else "—" for r in rows]))
    return table(["approach", "path", *(f"k = {k}" for k in ks)], "ll" + "r" * len(ks), lines)


def scaling_replicas_table(results: dict) -> str:
    found, k = points(results), results["k"]
    strategies = [s for s in ("none", "R1", f"R{results['replicas']}") if (s, k) in found]
    if len(strategies) < 2:
        return "*No scaling in replicas in this run.*"
    loads = [f"{found[(s, k)]['load_average_at_start'][0]:.1f}" for s in strategies]
    lines = ["| *1-minute load average when the group started* | | " + " | ".join(loads) + " |"]
    for proto in ours_and_baselines(found[(strategies[-1], k)]):
        rows = [ok_row(found[(s, k)], proto["key"]) for s in strategies]
        lines.append(line(proto, [
            "—" if r is None else f"{r['ms_per_micro_batch']['median']:.2f} ms"
            if proto["role"] == "baseline" else _overhead_cell(r) for r in rows]))
    return table(["approach", "path", *map(strategy_title, strategies)],
                 "ll" + "r" * len(strategies), lines)


def run_text(results: dict) -> str:
    """Which run, on what, with which sizes; and what the PyPI package did."""
    env, machine, sizes = results["environment"], results["machine"], results["sizes"]
    devices = ", ".join(d.rsplit("/", 1)[-1] for d in env.get("devices", []))
    gpus = env.get("physical_gpus") or []
    text = (
        f"Run of {results['started']} (`{results['command']}`, {results['wall_seconds']:.0f} s, "
        f"on top of commit {results.get('git_commit') or '?'}): TensorFlow {env['tensorflow']}, "
        f"Keras {env['keras']}, Python {env['python']}; {machine['cpu_count']} CPU cores"
        + (f", {len(gpus)} GPU(s)" if gpus else ", no GPU")
        + f"; replicas on {devices} ({env.get('cross_device_ops', '?')}); 1-minute load average "
        f"{machine['load_average_start'][0]:.1f} at the start, "
        f"{machine['load_average_end'][0]:.1f} at the end. Model: {sizes['features']} inputs, "
        f"{sizes['layers']} × Dense({sizes['hidden']}, tanh), Dense(1), float32, "
        f"{results['optimizer']}, `jit_compile=False`; micro-batch {sizes['micro_batch']} "
        f"examples (global); {sizes['micro_batches_per_block']} micro-batches per timed block; "
        f"{sizes['repeats']} rounds (main), {sizes['scaling_repeats']} (scaling).")
    pypi = results.get("pypi_package") or {}
    if not pypi.get("version"):
        return text + (" The PyPI package `gradient-accumulator` was **not installed** "
                       "(`pip install -e '.[bench]'`), so its rows say so.")
    text += f" PyPI `gradient-accumulator` {pypi['version']} was installed."
    for key, what in (("import_error", "Importing it failed"),
                      ("optimizer_error", ("Its `GradientAccumulateOptimizer` cannot be "
                                           "created on Keras 3 (the rows measure its model)"))):
        if pypi.get(key):
            message = " ".join(pypi[key]["message"].split())[:160]
            text += f" {what}: `{pypi[key]['type']}`: {cell(message)} …"
    return text


# --- files ----------------------------------------------------------------------------


def tables(results: dict) -> dict:
    """`{snippet name: markdown}` of one results file, in page order."""
    one, dist = main_group(results, False), main_group(results)
    missing = "*Not measured in this run.*"
    return {
        "run": run_text(results),
        "overhead-one-device": overhead_table(one) if one else missing,
        "overhead-distributed": overhead_table(dist) if dist else missing,
        "floor": floor_table(results),
        "kernels": kernels_table(results),
        "all-reduces": all_reduce_table(dist) if dist else missing,
        "memory": memory_table(dist) if dist else missing,
        "fresh-processes": fresh_table(results),
        "scaling-k": per_k_table(results, _overhead_cell, False),
        "scaling-k-kernels": (per_k_table(results, lambda r: share_text(kernel_share(r)), True)
                              if any(kernel_share(r) is not None for g in groups_of(
                                  results, "scaling_k") for r in g["rows"]) else NOT_RECORDED),
        "scaling-k-all-reduces": per_k_table(results, _measured_cell, True),
        "scaling-replicas": scaling_replicas_table(results),
    }


def gpu_section(results: dict, out_dir: Path) -> str:
    """Every table of a GPU run under `###` headings, with its plots."""
    parts, made = [], tables(results)
    for name, text in made.items():
        title = TITLES[name]
        parts += [f"### {title}", "", text, ""]
        plot = out_dir / f"{name.split('-')[0]}-gpu.png"
        if name in ("overhead-distributed", "memory", "scaling-replicas") and plot.is_file():
            parts += [f"![{title} (GPU)]({out_dir.name}/{plot.name})", ""]
    return "\n".join(parts)


def render_all(out_dir: Path) -> list[Path]:
    """Write the tables and plots of every results file in `out_dir`; the paths written.

    Raises FileNotFoundError when `out_dir` holds no results file.
    """
    from benchmarks import plots

    out_dir = Path(out_dir)
    found = load_results(out_dir)
    if not found:
        raise FileNotFoundError(f"no results.json or results-gpu.json in {out_dir}: run "
                                "`python -m benchmarks.run` first.")
    texts = dict(tables(found["cpu"])) if "cpu" in found else dict.fromkeys(
        TITLES, "*No CPU results in this folder: run `python -m benchmarks.run`.*")
    texts["gpu"] = gpu_section(found["gpu"], out_dir) if "gpu" in found else GPU_PLACEHOLDER
    written = []
    for name, text in texts.items():
        path = out_dir / f"{name}.md"
        path.write_text(text.rstrip() + "\n", encoding="utf-8")
        written.append(path)
    for label, results in found.items():
        written += plots.write_plots(results, out_dir, "" if label == "cpu" else f"-{label}")
    return written
