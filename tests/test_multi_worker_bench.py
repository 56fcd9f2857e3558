"""Smoke test of `benchmarks.multi_worker` at its quick size, and its pure functions.

The quick run's numbers mean nothing (577 parameters, one or two rounds). Checked: every
configuration runs its workers (2 worker processes, a network namespace of their own, a
rate-limited loopback), every approach is timed at every k in every round, the bytes on
the loopback follow the all-reduces (the plain step's grow with k, an accumulating
update moves fewer than k plain steps), the table and figure are written; the committed
table is what the report makes of the committed JSON; the fit and the verdict compute
what the page says.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import multi_worker  # noqa: E402 - after the sys.path fix above
from benchmarks.worker_bench import KEYS, block_of, loopback_bytes  # noqa: E402

DOCS = ROOT / "docs" / "performance"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(results, out dir) of one `python -m benchmarks.multi_worker --quick`."""
    out = tmp_path_factory.mktemp("multi-worker")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.multi_worker", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / multi_worker.JSON_NAME).read_text()), out


def _config(results, name):
    (config,) = [c for c in results["configs"] if c["name"] == name]
    return config


def test_quick_run_times_every_approach_at_every_k_in_every_round(quick):
    results, out = quick
    assert results["environment"]["namespace_refusal"] is None, (
        "`unshare --net` was refused: the benchmark needs root (or CAP_SYS_ADMIN) to give "
        "its workers a loopback of their own")
    assert [c["name"] for c in results["configs"]] == [
        c["name"] for c in multi_worker.PRESETS["quick"]["configs"]]
    two = _config(results, "2 workers")
    assert two["keys"] == list(KEYS) and two["per_replica_batch"] == 4
    for key in KEYS:
        for k in two["ks"]:
            cell = two["rows"][key][str(k)]
            assert len(cell["block_seconds"]) == two["rounds"], (key, k)
            assert all(s > 0 for s in cell["block_seconds"]), (key, k)
            examples = block_of(results["sizes"]["block"], k) * 4 * 2
            assert cell["seconds_per_example"] == pytest.approx(
                [s / examples for s in cell["block_seconds"]]), (key, k)
    assert (out / multi_worker.FIGURE_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / multi_worker.TABLE_NAME).read_text(encoding="utf-8")
    assert "**2 workers**" in table and "**2 workers, 100 Mbit/s**" in table
    assert all(label in table for label in multi_worker.LABELS.values())


def test_loopback_bytes_follow_the_all_reduces(quick):
    results, _ = quick
    two = _config(results, "2 workers")

    def per_update(key, k):
        return two["rows"][key][str(k)]["bytes_per_update"]

    # The plain step all-reduces every micro-batch: an update of 2 moves about twice 1's.
    assert 1.6 < per_update("plain", 2) / per_update("plain", 1) < 2.4
    # Accumulating: one gradient all-reduce per update (and a float flag), not k.
    for key in ("accumulating_optimizer", "gradient_accumulator", "micro_batching"):
        assert per_update(key, 2) < 0.9 * per_update("plain", 2), key
    # The mask trick all-reduces (zeros) on every micro-batch, as the plain step.
    assert per_update("mask_trick", 2) > 0.9 * per_update("plain", 2)
    # No all-reduce: only the barriers' few hundred bytes.
    assert per_update("compute_only", 2) < 0.2 * per_update("plain", 2)
    limited = _config(results, "2 workers, 100 Mbit/s")
    assert limited["rows"]["plain"]["2"]["bytes_per_update"] > 0


def test_committed_table_is_what_the_report_makes_of_the_committed_json(tmp_path):
    shutil.copy(DOCS / multi_worker.JSON_NAME, tmp_path / multi_worker.JSON_NAME)
    assert multi_worker.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert filecmp.cmp(tmp_path / multi_worker.TABLE_NAME, DOCS / multi_worker.TABLE_NAME,
                       shallow=False), ("docs/performance/multi-worker.md is stale: run "
                                        "`python -m benchmarks.multi_worker --report-only`")
    results = json.loads((DOCS / multi_worker.JSON_NAME).read_text())
    assert {c["workers"] for c in results["configs"]} >= {1, 2, 4}
    assert 20e6 <= results["parameters"] <= 50e6
    for config in results["configs"]:
        if config["workers"] > 1 and config["rate"] is None:
            assert config["ks"] == [1, 2, 4, 8, 16], config["name"]


def test_fit_line_recovers_compute_and_all_reduce_and_needs_two_ks():
    points = [(k, 3.0 + 8.0 / k) for k in (1, 2, 4, 8, 16)]
    line = multi_worker.fit_line(points)
    assert line["compute"] == pytest.approx(3.0)
    assert line["all_reduce"] == pytest.approx(8.0)
    assert line["r2"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="two or more distinct k"):
        multi_worker.fit_line([(4, 1.0), (4, 2.0)])


def test_a_verdict_only_when_every_round_agrees():
    assert multi_worker.verdict([1.0, 2.0], [2.0, 3.0]) == "faster"
    assert multi_worker.verdict([3.0, 4.0], [2.0, 3.0]) == "slower"
    assert multi_worker.verdict([1.0, 4.0], [2.0, 3.0]) == "not resolvable"


def test_summary_takes_the_chief_and_the_slowest_worker_for_compute_only():
    def worker(plain, compute, sent):
        return {"times": {"2": {"plain": plain, "compute_only": compute}},
                "bytes": {"2": {"plain": sent, "compute_only": [0, 0]}} if sent else None,
                "parameters": 10, "threads": 1, "per_replica_batch": 4}

    config = {"workers": 2, "keys": ["plain", "compute_only"], "ks": [2]}
    sizes = {"block": 4, "per_worker_batch": 4}
    rows = multi_worker.summarize([worker([1.0, 3.0], [1.0, 5.0], [800, 1200]),
                                   worker([9.0, 9.0], [2.0, 4.0], None)], config, sizes)["rows"]
    assert rows["plain"]["2"]["block_seconds"] == [1.0, 3.0]
    assert rows["compute_only"]["2"]["block_seconds"] == [2.0, 5.0]
    assert rows["plain"]["2"]["seconds_per_example"] == [1.0 / 32, 3.0 / 32]
    assert rows["plain"]["2"]["bytes_per_update"] == 1000 / 2  # median block, 2 updates
    assert block_of(4, 16) == 16 and block_of(4, 2) == 4


def test_loopback_bytes_reads_this_namespace_counter():
    before = loopback_bytes()
    assert isinstance(before, int) and before >= 0
    assert multi_worker.threads_per_worker(1) >= multi_worker.threads_per_worker(4) >= 1


def test_clusters_of_one_k_each_merge_into_one_record_per_worker():
    def run(k, chief):
        return {"times": {k: {"plain": [1.0]}}, "bytes": {k: {"plain": [8]}} if chief else None,
                "parameters": 10, "threads": 1, "per_replica_batch": 4 if k == "2" else None}

    merged = multi_worker.merge_clusters([[run("1", True), run("1", False)],
                                          [run("2", True), run("2", False)]])
    assert [sorted(w["times"]) for w in merged] == [["1", "2"], ["1", "2"]]
    assert sorted(merged[0]["bytes"]) == ["1", "2"] and merged[1]["bytes"] is None
    assert merged[0]["per_replica_batch"] == 4
