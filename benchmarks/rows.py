"""Reading a results file: where it is, its groups and rows, and their numbers as text.

Shared by `benchmarks.report` (tables) and `benchmarks.plots`. A results file is what
`benchmarks.run` writes: `groups` (one per timed group: section, strategy, k, rows) and,
per row, the timing summaries and the records of `benchmarks.measure`.
"""

from __future__ import annotations

import json
from pathlib import Path

TARGET_PERCENT = 3.0
MIB = 2**20
LABELS = ("cpu", "gpu")
PATH_ORDER = ("fit", "custom loop")
STRATEGY_TITLES = {"none": "no strategy (one device)", "R1": "MirroredStrategy, 1 replica"}
FRESH_TITLES = {"micro_batching": "MicroBatching, batch B in k micro-batches",
                "plain_micro_batch": "plain step on B/k", "plain_big_batch": "plain step on B"}


def results_file(out_dir: Path, label: str) -> Path:
    return Path(out_dir) / ("results.json" if label == "cpu" else f"results-{label}.json")


def load_results(out_dir: Path) -> dict:
    """`{label: results}` for every results file present in `out_dir`."""
    found = {}
    for label in LABELS:
        path = results_file(out_dir, label)
        if path.is_file():
            found[label] = json.loads(path.read_text(encoding="utf-8"))
    return found


def strategy_title(name: str) -> str:
    return STRATEGY_TITLES.get(name) or f"MirroredStrategy, {name[1:]} replicas"


def pct(value: float) -> str:
    return f"{value:+.1f} %"


def spread(stats: dict, low: str = "min", high: str = "max") -> str:
    return f"{stats[low]:+.1f} … {stats[high]:+.1f}"


def groups_of(results: dict, section: str) -> list:
    return [g for g in results.get("groups", []) if g["section"] == section]


def main_group(results: dict, distributed: bool = True):
    groups = [g for g in groups_of(results, "main") if (g["replicas"] > 1) == distributed
              and (distributed or g["strategy"] == "none")]
    return groups[0] if groups else None


def ordered_rows(group: dict, roles=("baseline", "approach", "reference")) -> list:
    rank = {"baseline": 0, "approach": 1, "reference": 2, "floor": 3}
    return sorted((r for r in group["rows"] if r["role"] in roles),
                  key=lambda r: (PATH_ORDER.index(r["path"]), rank[r["role"]], not r.get("ours")))


def ok_row(group, key):
    row = next((r for r in group["rows"] if r["key"] == key), None) if group else None
    return row if row and row["status"] == "ok" else None


def ours_and_baselines(group: dict) -> list:
    return [r for r in ordered_rows(group, ("baseline", "approach"))
            if r.get("ours") or r["role"] == "baseline"]


def points(results: dict) -> dict:
    """`{(strategy, k): group}` of every group."""
    return {(g["strategy"], g["k"]): g for g in results.get("groups", [])}


def kernel_share(row: dict) -> float | None:
    """The accumulation kernels' share of the update's op time (%), if traced."""
    op_time = row.get("op_time")
    return None if op_time is None else sum(op_time["percent"].values())
