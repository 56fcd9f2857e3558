"""Smoke test of `benchmarks/`: the whole benchmark at its quick size, in a fresh process.

The numbers of a quick run mean nothing (32 hidden units, two rounds). Checked: every
section is produced and well-formed; every table the hand-written Performance page
includes is written, and the committed ones are what the report makes of the committed
JSON; the all-reduce counts are the page's facts (ours 1 per update, the plain step k,
graph = derived = profiler-measured); the op-time categories find the accumulation's
kernels in real traces; Keras' built-in accumulation and the PyPI package fail under
MirroredStrategy as the page says; bad options fail clearly.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import measure, report, run, trace  # noqa: E402 - after sys.path

MERGE_CALL_ERROR = "`merge_call` called while defining a new graph or a tf.function."
OURS = {"accumulating_optimizer_fit", "micro_batching_fit", "gradient_accumulator_custom",
        "accumulating_optimizer_custom"}
PLAIN = {"plain_fit", "plain_custom"}
PAGE = ROOT / "docs" / "performance.md"
INCLUDE = re.compile(r'^--8<-- "performance/([a-z0-9-]+\.md)"$', re.MULTILINE)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(results, out dir) of one `python -m benchmarks.run --quick`."""
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), out


def _group(results, section, strategy, k=None):
    groups = [g for g in results["groups"] if g["section"] == section
              and g["strategy"] == strategy and (k is None or g["k"] == k)]
    assert len(groups) == 1, [(g["section"], g["strategy"], g["k"]) for g in results["groups"]]
    return groups[0]


def _rows(group):
    return {r["key"]: r for r in group["rows"]}


# --- files ------------------------------------------------------------------------------


def test_quick_run_writes_json_three_plots_and_every_table_the_page_includes_once(quick):
    results, out = quick
    assert results["schema"] == run.SCHEMA and results["label"] == "cpu"
    assert results["preset"] == "quick"
    for name in ("overhead.png", "scaling.png", "memory.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    page = PAGE.read_text(encoding="utf-8")
    included = INCLUDE.findall(page)
    written = sorted(p.name for p in out.glob("*.md"))
    # Each generated file is included exactly once (multi-worker.md is written by
    # benchmarks.multi_worker, tests/test_multi_worker_bench.py; iterator-free.md by
    # benchmarks.iterator_free, below), and the page holds no table itself.
    assert written == sorted(f"{n}.md" for n in [*report.TITLES, "gpu"])
    assert sorted(included) == sorted([*written, "multi-worker.md", "iterator-free.md"])
    assert not [line for line in page.splitlines() if line.startswith("|")]
    for name in written:
        assert (out / name).read_text(encoding="utf-8").strip(), name
    assert "](performance/overhead.png)" in page and "](performance/results.json)" in page
    # Without a GPU run, the GPU section says so and holds no number.
    gpu = (out / "gpu.md").read_text(encoding="utf-8")
    assert "No GPU figures have been measured yet" in gpu
    assert " ms" not in gpu and "%" not in gpu


def test_committed_tables_are_what_the_report_makes_of_the_committed_json(tmp_path):
    docs = ROOT / "docs" / "performance"
    for name in ("results.json", "results-gpu.json"):
        if (docs / name).is_file():
            shutil.copy(docs / name, tmp_path / name)
    report.render_all(tmp_path)
    for made in tmp_path.glob("*.md"):
        assert filecmp.cmp(made, docs / made.name, shallow=False), (
            f"docs/performance/{made.name} is stale: run `python -m benchmarks.run --report-only`")


def test_the_iterator_free_table_is_what_the_report_makes_of_its_committed_json(tmp_path):
    from benchmarks import iterator_free

    shutil.copy(ROOT / "docs" / "performance" / "iterator_free.json", tmp_path)
    results = iterator_free.main(["--report-only", "--out", str(tmp_path)])
    assert filecmp.cmp(tmp_path / "iterator-free.md",
                       ROOT / "docs" / "performance" / "iterator-free.md", shallow=False), (
        "docs/performance/iterator-free.md is stale: run "
        "`python -m benchmarks.iterator_free --report-only`")
    for age in results["ages_s"]:  # a row per age, each cell over every round
        for autotune in ("on", "off"):
            assert len(results["free_s"][f"{autotune} {age}"]) == results["rounds"]


def test_a_verdict_only_when_the_quartiles_are_within_the_target():
    def row(q1, median, q3, ours=True, role="approach"):
        return {"ours": ours, "role": role,
                "overhead_percent": {"q1": q1, "median": median, "q3": q3}}

    assert report.verdict(row(0.5, 1.0, 3.0)) == "yes"
    assert report.verdict(row(3.5, 4.0, 5.0)) == "no"
    # A median well below the target is no verdict when the middle half of the rounds
    # spans more than the target (the second: MicroBatching, one device, results.json).
    assert report.verdict(row(-9.0, -6.0, -5.9)) == report.NOT_RESOLVABLE
    assert report.verdict(row(-13.6, -7.4, -2.2)) == report.NOT_RESOLVABLE
    assert report.verdict(row(0.0, 1.0, 2.0, ours=False)) == ""
    assert report.verdict(row(0.0, 1.0, 9.0, ours=False, role="reference")) == "(reference)"


def test_every_approach_has_a_row_in_both_main_groups_and_the_environment_is_recorded(quick):
    results, _ = quick
    expected = {"plain_fit", "plain_big_fit", "accumulating_optimizer_fit", "micro_batching_fit",
                "keras_builtin_fit", "mask_trick_fit", "pypi_gradient_accumulator_fit",
                "plain_custom", "gradient_accumulator_custom", "accumulating_optimizer_custom"}
    for strategy in ("none", "R2"):
        assert set(_rows(_group(results, "main", strategy))) == expected
    env = results["environment"]
    assert env["replicas"] == 2 and env["strategy"] == "MirroredStrategy"
    assert len(results["machine"]["load_average_start"]) == 3
    assert results["wall_seconds"] > 0


# --- timing statistics -------------------------------------------------------------------


def test_every_timed_row_has_one_time_per_round_and_consistent_statistics(quick):
    results, _ = quick
    for group in results["groups"]:
        for row in group["rows"]:
            if row["status"] != "ok":
                continue
            assert len(row["seconds"]) == group["repeats"] and min(row["seconds"]) > 0
            for key in ("ms_per_micro_batch", "overhead_percent", "vs_baseline"):
                if key not in row:
                    continue
                stats = row[key]
                assert stats["min"] <= stats["q1"] <= stats["median"] <= stats["q3"] <= stats["max"]
                assert stats["n"] == group["repeats"]
            if row["role"] == "baseline":
                assert "overhead_percent" not in row
            else:
                ratio = row["vs_baseline"]["median"]
                assert row["overhead_percent"]["median"] == pytest.approx(100 * (ratio - 1))


def test_summary_and_paired_ratios_are_computed_per_round():
    stats = measure.summary([3.0, 1.0, 2.0, 10.0])
    assert (stats["min"], stats["median"], stats["max"], stats["n"]) == (1.0, 2.5, 10.0, 4)
    assert stats["q1"] == pytest.approx(1.75) and stats["q3"] == pytest.approx(4.75)
    assert measure.paired_ratios([2.0, 3.0], [1.0, 4.0]) == [2.0, 0.75]
    with pytest.raises(ValueError, match="one baseline time per round"):
        measure.paired_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="summary of no values"):
        measure.summary([])


# --- all-reduces --------------------------------------------------------------------------


def test_ours_make_one_all_reduce_per_update_the_plain_step_k_graph_derived_traced(quick):
    results, _ = quick
    group = _group(results, "main", "R2")
    k = group["k"]
    rows = _rows(group)
    for key in OURS:
        counts = rows[key]["all_reduces"]
        assert counts["derived_per_update"] == 1 and counts["measured_per_update"] == 1, key
    for key in PLAIN | {"mask_trick_fit"}:
        counts = rows[key]["all_reduces"]
        assert counts["derived_per_update"] == k and counts["measured_per_update"] == k, key
        assert counts["graph"]["step"] == {"every_call": 1, "conditional": 0}
    # Where the one all-reduce sits: inside the cond (AccumulatingOptimizer), in the apply
    # function only (GradientAccumulator), once per fit step (MicroBatching).
    for key in ("accumulating_optimizer_fit", "accumulating_optimizer_custom"):
        assert rows[key]["all_reduces"]["graph"]["step"] == {"every_call": 0, "conditional": 1}
        assert rows[key]["all_reduces"]["calls_per_update"]["step"] == {"calls": k,
                                                                        "branch_runs": 1}
    assert rows["gradient_accumulator_custom"]["all_reduces"]["graph"] == {
        "accumulate": {"every_call": 0, "conditional": 0},
        "apply": {"every_call": 1, "conditional": 0}}
    assert rows["micro_batching_fit"]["all_reduces"]["graph"]["step"] == {"every_call": 1,
                                                                          "conditional": 0}


def test_scaling_groups_cover_every_k_and_one_replica_and_all_reduces_follow_k(quick):
    results, _ = quick
    assert results["ks"] == [1, 2] and results["k"] == 2
    single = _group(results, "scaling_replicas", "R1", results["k"])
    assert single["replicas"] == 1 and set(_rows(single)) == OURS | PLAIN
    assert set(_rows(_group(results, "scaling_k", "R2", 1))) == OURS | PLAIN
    for k in results["ks"]:
        group = _group(results, "main" if k == results["k"] else "scaling_k", "R2", k)
        rows = _rows(group)
        for key in OURS:
            assert rows[key]["all_reduces"]["measured_per_update"] == 1, (k, key)
        for key in PLAIN:
            assert rows[key]["all_reduces"]["measured_per_update"] == k, (k, key)


class _TwoReplicasTwoCalls:
    """A runner on 2 replicas whose update is 2 calls of one all-reduce each."""
    replicas = 2

    def __init__(self):
        self.calls = 0

    def run(self, updates):
        self.calls += 2 * updates

    def executions(self):
        return {"step": (self.calls, 0)}

    def placement(self):
        return {"step": SimpleNamespace(every_call=1, conditional=0)}


def test_a_trace_with_fewer_all_reduces_than_the_graph_derives_is_retaken(monkeypatch):
    # Seen in a quick run: one call's kernels lost on both replicas (2 of 4, a multiple of R).
    counts = iter([2, 4])
    monkeypatch.setattr(trace, "profile", lambda fn: (fn(), [b""])[1])
    monkeypatch.setattr(trace, "all_reduce_events", lambda space: next(counts))
    monkeypatch.setattr(trace, "op_time", lambda spaces, updates: {})
    record, _ = measure.traced_update(_TwoReplicasTwoCalls())
    assert record["measured_per_update"] == 2 == record["derived_per_update"]
    assert record["profiler_traces"] == 2
    counts = iter([2, 2, 2])
    with pytest.raises(ValueError, match=r"counts \[2, 2, 2\] on 2 replicas"):
        measure.traced_update(_TwoReplicasTwoCalls())


def test_derived_count_is_graph_counts_times_calls_and_branch_runs():
    placement = {"accumulate": {"every_call": 0, "conditional": 0},
                 "step": {"every_call": 1, "conditional": 2}}
    before = {"accumulate": (3, 0), "step": (10, 1)}
    after = {"accumulate": (7, 0), "step": (14, 2)}
    assert measure.derived_all_reduces(placement, before, after) == 1 * 4 + 2 * 1


def test_profiler_events_count_all_reduce_kernels_on_host_planes_only():
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    for plane_name in ("/host:CPU", "/device:GPU:0"):
        plane = space.planes.add(name=plane_name)
        plane.event_metadata[1].name = "sgd/CollectiveReduceV2:CollectiveReduceV2"
        plane.event_metadata[2].name = "CollectiveOpV2Kernel::Run"
        plane.event_metadata[3].name = "dense/MatMul:MatMul"
        line = plane.lines.add()
        for metadata_id in (1, 1, 2, 3, 1):
            line.events.add(metadata_id=metadata_id)
    assert trace.all_reduce_events(space.SerializeToString()) == 3


# --- op time by kernel category -------------------------------------------------------


def _tiny_step(optimizer):
    """A traced custom-loop step (no strategy) of a 2-layer model, run once."""
    import keras
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    x, y = tf.ones((2, 4)), tf.ones((2, 1))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    step()
    return step


def test_op_time_finds_the_accumulating_optimizers_kernels_in_a_real_trace():
    import keras

    from distgrad.optimizer import AccumulatingOptimizer

    plain = _tiny_step(keras.optimizers.SGD(0.1))
    accumulating = _tiny_step(AccumulatingOptimizer(keras.optimizers.SGD(0.1), 2))
    plain_record = trace.op_time(trace.profile(lambda: [plain() for _ in range(2)]))
    spaces = trace.profile(lambda: [accumulating() for _ in range(2)])  # one update
    types = [op_type for space in spaces for _, op_type, _ in trace.op_events(space)]
    # 4 variables: one buffer += gradient each per micro-batch; one IsFinite per buffer.
    assert types.count("AssignAddVariableOp") == 8 and types.count("IsFinite") == 4
    record = trace.op_time(spaces)
    assert record["kernels"]["accumulate"] == 8 and record["kernels"]["finiteness check"] >= 4
    assert record["total_us"] > sum(record["us"].values()) > 0
    assert record["percent"]["accumulate"] == pytest.approx(
        100 * record["us"]["accumulate"] / record["total_us"])
    # The plain step runs none of them: only Keras' own counter assigns.
    assert plain_record["kernels"]["accumulate"] == plain_record["kernels"]["finiteness check"] == 0
    assert plain_record["kernels"]["assign"] > 0
    assert not any(trace.all_reduce_events(space) for space in spaces)  # no strategy
    # Executor bookkeeping events are not op kernels.
    names = {name for space in spaces for name, _, _ in trace.op_events(space)}
    assert not [n for n in names if "ExecutorState" in n or " " in n]
    assert trace.category("micro_batches/body/_1/micro_batches/add_4", "AddV2") == "accumulate"
    assert trace.category("functional/dense/Add", "AddV2") is None


def test_quick_run_traces_the_accumulation_kernels_of_ours_and_none_in_the_plain_step(quick):
    results, _ = quick
    variables = 4  # Dense(hidden) and Dense(1): kernel and bias each
    for strategy in ("none", "R2"):
        group = _group(results, "main", strategy)
        rows = _rows(group)
        for key in OURS:  # each micro-batch adds every gradient once, on every replica
            # (MicroBatching: AddV2 in its loop body, the others: AssignAddVariableOp)
            kernels = rows[key]["op_time"]["kernels"]
            assert kernels["accumulate"] >= variables * group["k"] * group["replicas"], key
            assert 0 < report.kernel_share(rows[key]) < 100
        for key in ("accumulating_optimizer_fit", "accumulating_optimizer_custom"):
            assert rows[key]["op_time"]["kernels"]["finiteness check"] > 0
        for key in PLAIN:
            kernels = rows[key]["op_time"]["kernels"]
            assert kernels["accumulate"] == kernels["finiteness check"] == 0, (strategy, key)


# --- what does not run, and why ------------------------------------------------------------


def test_keras_builtin_and_pypi_model_run_alone_and_raise_merge_call_error_mirrored(quick):
    results, _ = quick
    alone, mirrored = _rows(_group(results, "main", "none")), _rows(_group(results, "main", "R2"))
    assert alone["keras_builtin_fit"]["status"] == "ok"
    builtin = mirrored["keras_builtin_fit"]
    assert builtin["status"] == "error" and builtin["error"]["type"] == "RuntimeError"
    assert MERGE_CALL_ERROR in builtin["error"]["message"]
    assert "\x1b[" not in builtin["error"]["message"]  # Keras' colour codes are stripped
    pypi = results["pypi_package"]
    if pypi["version"] is None:
        for rows in (alone, mirrored):
            assert rows["pypi_gradient_accumulator_fit"]["status"] == "not run"
            assert "not installed" in rows["pypi_gradient_accumulator_fit"]["reason"]
        return
    assert alone["pypi_gradient_accumulator_fit"]["status"] == "ok"
    package = mirrored["pypi_gradient_accumulator_fit"]
    assert package["error"]["type"] == "RuntimeError"
    assert MERGE_CALL_ERROR in package["error"]["message"]
    if pypi["version"] == "0.4.2":
        assert pypi["optimizer_error"]["type"] == "ImportError"
        assert "`keras.optimizers.legacy` is not supported in Keras 3" in \
            pypi["optimizer_error"]["message"]


# --- memory ---------------------------------------------------------------------------------


def test_memory_records_exist_for_each_distributed_runner_and_each_fresh_process(quick):
    results, _ = quick
    for row in _group(results, "main", "R2")["rows"]:
        if row["status"] != "ok":
            continue
        memory = row["memory"]
        assert memory["device"] == "CPU:0" and memory["step_bytes"] >= 0
        assert memory["peak"] >= memory["current_before"] >= 0
        # Accumulating approaches keep one buffer per variable; the plain step keeps none.
        if row["key"] in {"plain_fit", "plain_custom", "micro_batching_fit", "plain_big_fit"}:
            assert memory["state_bytes_per_replica"] == 0
        else:
            assert memory["state_bytes_per_replica"] > 0
    fresh = {f["config"]: f for f in results["fresh_process_memory"]}
    assert set(fresh) == {"micro_batching", "plain_micro_batch", "plain_big_batch"}
    k, micro = results["k"], results["sizes"]["micro_batch"]
    assert (fresh["micro_batching"]["batch_size"], fresh["micro_batching"]["micro_batches"]) \
        == (k * micro, k)
    assert fresh["plain_micro_batch"]["batch_size"] == micro
    assert all(f["rss_peak"] >= f["rss_before"] > 0 for f in fresh.values())


def test_accumulator_buffers_are_one_float32_copy_of_the_weights(quick):
    results, _ = quick
    s = results["sizes"]
    weights = (s["features"] * s["hidden"] + s["hidden"]
               + (s["layers"] - 1) * (s["hidden"] * s["hidden"] + s["hidden"]) + s["hidden"] + 1)
    rows = _rows(_group(results, "main", "R2"))
    # + the int64 micro-step counter
    assert rows["gradient_accumulator_custom"]["memory"]["state_bytes_per_replica"] \
        == 4 * weights + 8


# --- options and errors ---------------------------------------------------------------------


def test_bad_options_fail_naming_the_choices_and_defaults_write_into_the_docs(tmp_path):
    with pytest.raises(SystemExit, match="unknown --sections \\['bogus'\\]; choose from main"):
        run._defaults(run._parse(["--sections", "main,bogus"]))
    with pytest.raises(SystemExit, match="--replicas must be >= 2"):
        run._defaults(run._parse(["--replicas", "1"]))
    with pytest.raises(FileNotFoundError, match="run `python -m benchmarks.run` first"):
        report.render_all(tmp_path)
    # Defaults: the docs folder; --quick goes to the ignored results folder.
    full = run._defaults(run._parse([]))
    assert full.out == ROOT / "docs" / "performance"
    assert full.k == 4 and full.ks == [1, 2, 4, 8]
    quick = run._defaults(run._parse(["--quick"]))
    assert quick.out == ROOT / "benchmarks" / "results" / "quick" and quick.ks == [1, 2]


def test_require_gpu_stops_before_measuring_when_tensorflow_sees_no_gpu(tmp_path):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU machine")
    args = run._defaults(run._parse(["--require-gpu", "--out", str(tmp_path)]))
    with pytest.raises(SystemExit, match="no GPU visible to TensorFlow; this run measures GPU "
                                         "figures only"):
        run.measure(args)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                    reason="a GPU machine: gpu.sh would run the GPU benchmark")
def test_gpu_script_refuses_to_run_without_a_gpu(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
             "PY": sys.executable},
    )
    assert done.returncode == 1
    assert "no GPU visible (nvidia-smi not found); this run measures GPU figures only" \
        in done.stderr
    assert not list(tmp_path.iterdir())
