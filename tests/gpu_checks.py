"""GPU-only checks: what the CPU simulation (`distgrad_course.lab.xla_path`) cannot show.

Run by `make gpu-check` on a machine with GPUs, never by `make test` (pytest collects
`test_*.py` only). Without a GPU every check fails: none is skipped. Each check writes
what it measured into `build/gpu-check/results.json`; `tests/gpu_report.py` turns that
and the lesson results into `build/gpu-check/report.md`.

1. **The real XLA path.** `model.compile(jit_compile=True)` under `make_strategy()` on
   GPUs: the step takes TensorFlow's no-merge-call path, and `AccumulatingOptimizer`
   (in `fit` and in a custom loop) and `MicroBatching` equal one-device big batch at
   float32 1e-6 (TF32 off); `non_finite="raise"` fails at the first step naming the fix.
2. **The all-reduces per update**, in the traced compiled step (the graph XLA compiles)
   and as NCCL kernels the GPUs ran (a profiler trace of the device planes).
3. **GPU memory**: the step's peak on replica 0's GPU, plain vs k micro-batches.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


import distgrad_course

REPORT_DIR = pathlib.Path(os.environ.get("DISTGRAD_GPU_CHECK_DIR", "build/gpu-check"))
K, MICRO, UPDATES = 2, 8, 3  # MICRO: the global micro-batch, divisible by 2 and 4 replicas
RESULTS: dict = {}


@pytest.fixture(scope="module")
def strategy():
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    assert gpus, ("make gpu-check needs a GPU that TensorFlow sees: install "
                  "tensorflow[and-cuda] (docs/guides/gpu.md); these checks never skip.")
    strategy = distgrad_course.make_strategy()
    assert strategy.num_replicas_in_sync >= 2, "set DISTGRAD_REPLICAS >= 2"
    RESULTS["environment"] = distgrad_course.environment_report(strategy)
    yield strategy
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "results.json").write_text(json.dumps(RESULTS, indent=2, default=str))


def _data(updates=UPDATES):
    from distgrad_course.lab.data import regression_data

    return regression_data(MICRO * K * updates)


def _big_batch(name):
    from distgrad_course.lab.compare import OPTIMIZERS
    from distgrad_course.lab.recipes import fit_run

    x, y = _data()
    return fit_run(None, OPTIMIZERS[name], x, y, MICRO * K, jit_compile=False).final


def _record(check, **values):
    RESULTS.setdefault(check, []).append(values)


def _skipping(name, accumulation_steps=1):
    """`name`'s optimizer in an `AccumulatingOptimizer` with `non_finite="skip"`: on the
    no-merge-call path the only way to skip a non-finite update (and "raise" cannot raise
    in a compiled step), which `MicroBatching` defers to."""
    from distgrad.optimizer import AccumulatingOptimizer
    from distgrad_course.lab.compare import OPTIMIZERS

    return lambda: AccumulatingOptimizer(OPTIMIZERS[name](), accumulation_steps,
                                         non_finite="skip")


def test_a_compiled_step_takes_the_no_merge_call_path(strategy):
    import tensorflow as tf

    seen = []

    @tf.function(jit_compile=True)
    def step():
        strategy.run(lambda: seen.append(
            bool(tf.__internal__.distribute.strategy_supports_no_merge_call())))

    step.get_concrete_function()
    _record("no_merge_call_path", replicas=strategy.num_replicas_in_sync, seen=seen)
    assert seen == [True] * strategy.num_replicas_in_sync


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_accumulating_optimizer_in_compiled_fit_equals_big_batch(strategy, name):
    from distgrad_course.lab.compare import check_close, weight_diff
    from distgrad_course.lab.recipes import fit_run

    x, y = _data()
    run = fit_run(strategy, _skipping(name, K), x, y, MICRO, jit_compile=True)
    reference = _big_batch(name)
    _record("xla_fit_accumulating_optimizer", optimizer=name, updates=run.updates,
            max_abs_diff=weight_diff(run.final, reference).max_abs)
    check_close(run.final, reference)
    assert (run.updates, run.total_micro_steps) == (UPDATES, UPDATES * K)


def test_micro_batching_in_compiled_fit_equals_big_batch(strategy):
    from distgrad.train_step import with_micro_batches
    from distgrad_course.lab.compare import check_close, weight_diff
    from distgrad_course.lab.data import tiny_model
    from distgrad_course.lab.recipes import fit_run

    x, y = _data()
    run = fit_run(strategy, _skipping("adam"), x, y, MICRO * K, jit_compile=True,
                  model_factory=lambda: with_micro_batches(tiny_model(), K, non_finite="skip"))
    reference = _big_batch("adam")
    _record("xla_fit_micro_batching", updates=run.updates,
            max_abs_diff=weight_diff(run.final, reference).max_abs)
    check_close(run.final, reference)
    assert run.updates == UPDATES


def test_accumulating_optimizer_in_a_compiled_custom_loop_equals_big_batch(strategy):
    import tensorflow as tf

    from distgrad_course.lab.compare import check_close, weight_diff, weights_of
    from distgrad_course.lab.data import tiny_model
    from distgrad_course.lab.recipes import make_replica_step

    x, y = _data()
    with strategy.scope():
        model = tiny_model()
        optimizer = _skipping("adam", K)()
        optimizer.build(model.trainable_variables)
    replica_step = make_replica_step(MICRO)  # the wrapper applies the mean of k micro-batches
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)

    @tf.function(jit_compile=True)
    def micro_step(batch):
        return strategy.run(replica_step, args=(model, optimizer, *batch))

    for batch in strategy.experimental_distribute_dataset(dataset):
        micro_step(batch)
    reference = _big_batch("adam")
    _record("xla_custom_loop_accumulating_optimizer",
            updates=int(optimizer.iterations.numpy()),
            max_abs_diff=weight_diff(weights_of(model), reference).max_abs)
    check_close(weights_of(model), reference)
    assert int(optimizer.iterations.numpy()) == UPDATES


def test_raise_policy_fails_at_the_first_compiled_step_naming_the_fix(strategy):
    from distgrad.optimizer import AccumulatingOptimizer
    from distgrad_course.lab.compare import OPTIMIZERS
    from distgrad_course.lab.recipes import fit_run

    x, y = _data(1)
    with pytest.raises(ValueError, match="non_finite='skip'") as info:
        fit_run(strategy, lambda: AccumulatingOptimizer(OPTIMIZERS["sgd"](), K), x, y, MICRO,
                jit_compile=True)
    _record("xla_raise_policy", error=str(info.value)[:300])


def _nccl_kernels(spaces) -> collections.Counter:
    """GPU kernels whose name mentions NCCL, on the device planes of profiler traces."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    names = collections.Counter()
    for data in spaces:
        space = xplane_pb2.XSpace()
        space.ParseFromString(data)
        for plane in space.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                for event in line.events:
                    name = plane.event_metadata[event.metadata_id].name
                    if "nccl" in name.lower():
                        names[name] += 1
    return names


def test_all_reduces_per_update_in_the_compiled_step(strategy):
    import glob
    import tempfile

    import tensorflow as tf

    from distgrad_course.lab.graph import fit_step_all_reduce_sizes
    from distgrad_course.lab.recipes import fit_run

    x, y = _data(1)
    run = fit_run(strategy, _skipping("adam"), x, y, MICRO, jit_compile=True)
    sizes = fit_step_all_reduce_sizes(run.model, x, y, MICRO)
    with tempfile.TemporaryDirectory(prefix="distgrad-gpu-trace-") as logdir:
        tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=2, device_tracer_level=1, python_tracer_level=0))
        try:
            run.model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)  # one update
        finally:
            tf.profiler.experimental.stop()
        spaces = [pathlib.Path(p).read_bytes()
                  for p in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)]
    nccl = _nccl_kernels(spaces)
    physical = len(tf.config.list_physical_devices("GPU"))
    _record("all_reduces_per_update", graph_sizes=sizes, nccl_kernels=dict(nccl),
            physical_gpus=physical, replicas=strategy.num_replicas_in_sync)
    # As in the CPU simulation (tests/accumulating_optimizer/test_optimizer_no_merge_call.py):
    # every gradient element in one packed all-reduce, and the replicas' finiteness flags in
    # one of one element.
    parameters = sum(int(v.shape.num_elements()) for v in run.model.trainable_variables)
    assert sizes == [parameters, 1]
    if physical >= strategy.num_replicas_in_sync:  # physical GPUs: MirroredStrategy's NCCL
        assert sum(nccl.values()) >= 1, "no NCCL kernel ran on physical GPUs"


def test_step_memory_on_the_gpu_plain_and_micro_batched(strategy):
    import numpy as np

    from distgrad_course.lab.memory import measure_step_memory, wide_mlp
    from distgrad_course.lab.recipes import fit_run

    batch, features, hidden = 4096, 512, 2048
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, features)).astype("float32")
    y = rng.normal(size=(batch, 1)).astype("float32")
    peaks = {}
    for k in (1, 4):
        run = fit_run(strategy, _skipping("adam"), x, y, batch, jit_compile=True,
                      model_factory=lambda k=k: wide_mlp(features, hidden, 2, k, "skip"))
        step = measure_step_memory(
            lambda run=run: run.model.fit(x, y, batch_size=batch, shuffle=False, verbose=0),
            device="GPU:0")
        peaks[k] = step.step_bytes
    _record("step_memory_gpu0", batch=batch, features=features, hidden=hidden,
            step_bytes_by_accumulation_steps=peaks)
    assert peaks[4] < peaks[1], "k micro-batches should need less activation memory"
