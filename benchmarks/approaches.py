"""Which ways of training are compared, in which group, and how each is built.

All train the same MLP on the same data with SGD (`benchmarks.runners`). The plain
runners make one optimizer step per micro-batch (the "plain micro-batch step" every
overhead is measured against); "plain B" makes one step per update on the whole batch
of `k * micro_batch` (no accumulation, `k` times the activation memory).

| key | how it trains | path |
|---|---|---|
| `plain_fit` | `model.fit(batch_size=micro_batch)`, SGD | fit (baseline) |
| `plain_big_fit` | `model.fit(batch_size=k * micro_batch)` | fit (reference) |
| `accumulating_optimizer_fit` | `distgrad.optimizer.AccumulatingOptimizer(SGD, k)` in fit | fit |
| `micro_batching_fit` | `distgrad.train_step.with_micro_batches(model, k)`, batch k*micro | fit |
| `keras_builtin_fit` | `keras.optimizers.SGD(gradient_accumulation_steps=k)` | fit |
| `mask_trick_fit` | `pitfalls.mask_trick.patch_with_mask` (apply `acc * 0/1`) | fit |
| `pypi_gradient_accumulator_fit` | PyPI `gradient-accumulator`'s `GradientAccumulateModel` | fit |
| `plain_custom` | `strategy.run(make_replica_step(...))` per micro-batch | custom loop (baseline) |
| `gradient_accumulator_custom` | `AccumulatedTrainer` (k calls, 1 apply) | custom loop |
| `accumulating_optimizer_custom` | `plain_custom` with an `AccumulatingOptimizer` | custom loop |
| `floor_fit`, `floor_custom` | the plain runners, a model of 1 hidden unit | fixed step cost |

The runners live in `benchmarks.fit_runners` and `benchmarks.loop_runners`, what they
share in `benchmarks.runners`. A runner that cannot run (Keras' built-in
accumulation and the PyPI package under `MirroredStrategy`, the package when it is not
installed) is returned as a `Failed` record with the exception it raised.
"""

from __future__ import annotations

from benchmarks.fit_runners import (
    PYPI_PACKAGE,
    AccumulatingOptimizerFit,
    FloorFit,
    KerasBuiltinFit,
    MaskTrickFit,
    MicroBatchingFit,
    PlainBigFit,
    PlainFit,
    PypiGradientAccumulatorFit,
    pypi_package_status,
)
from benchmarks.loop_runners import (
    AccumulatingOptimizerCustom,
    FloorCustom,
    GradientAccumulatorCustom,
    PlainCustom,
)
from benchmarks.runners import Failed
from distgrad_course.pitfalls import CapturedError

OURS = (AccumulatingOptimizerFit, MicroBatchingFit, GradientAccumulatorCustom,
        AccumulatingOptimizerCustom)
# The scaling sweeps: ours and the baselines they are compared with.
SCALING = (PlainFit, PlainCustom, *OURS)
# The main comparison: everything, in the order of the tables.
MAIN_ORDER = (PlainFit, PlainBigFit, AccumulatingOptimizerFit, MicroBatchingFit,
              KerasBuiltinFit, MaskTrickFit, PypiGradientAccumulatorFit,
              PlainCustom, GradientAccumulatorCustom, AccumulatingOptimizerCustom,
              FloorFit, FloorCustom)


def build(runner_class, strategy, sizes, k, x, y):
    """The runner, traced and run once; or a `Failed` record with what went wrong."""
    failed = Failed(runner_class.key, runner_class.label, runner_class.path,
                    runner_class.role, runner_class.ours)
    if runner_class is KerasBuiltinFit and k < 2:
        failed.reason = "Keras requires gradient_accumulation_steps >= 2."
        return failed
    if runner_class is PypiGradientAccumulatorFit:
        version, import_error = pypi_package_status()
        if version is None:
            failed.reason = (f"{PYPI_PACKAGE} is not installed (pip install -e '.[bench]'; "
                             "see the Performance page for what pip resolves).")
            return failed
        if import_error is not None:
            failed.error = import_error
            return failed
    try:
        return runner_class(strategy, sizes, k, x, y)
    except Exception as err:  # the record says what it was
        failed.error = CapturedError.of(err)
        return failed
