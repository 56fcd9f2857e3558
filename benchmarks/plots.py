"""The Performance page's plots (PNG, matplotlib's Agg backend) from one results file.

`overhead*.png`: each approach's overhead in the main groups, median and min … max;
`scaling*.png`: overhead and all-reduces per update against k, overhead against the
replica count; `memory*.png`: allocator bytes of one update and peak RSS growth in
fresh processes. A plot whose groups are not in the file is not written.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.rows import (
    FRESH_TITLES,
    MIB,
    TARGET_PERCENT,
    groups_of,
    main_group,
    ok_row,
    ordered_rows,
    ours_and_baselines,
    points,
    strategy_title,
)


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
    found = points(results)
    ks = [k for k in results["ks"] if (distributed, k) in found]
    strategies = [s for s in ("none", "R1", distributed) if (s, results["k"]) in found]
    if not ks:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    reference = found[(distributed, ks[-1])]
    ours = [r for r in ours_and_baselines(reference) if r.get("ours")]
    for proto in ours:
        rows = [ok_row(found[(distributed, k)], proto["key"]) for k in ks]
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
    for proto in ours_and_baselines(reference):
        rows = [ok_row(found[(distributed, k)], proto["key"]) for k in ks]
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
            row = ok_row(found[(strategy, results["k"])], proto["key"])
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


def write_plots(results: dict, out_dir: Path, tail: str = "") -> list[Path]:
    """`overhead{tail}.png`, `scaling{tail}.png`, `memory{tail}.png` in `out_dir`, those
    the results have data for."""
    made = [plot_overhead(results, out_dir / f"overhead{tail}.png"),
            plot_scaling(results, out_dir / f"scaling{tail}.png"),
            plot_memory(results, out_dir / f"memory{tail}.png")]
    return [p for p in made if p is not None]
