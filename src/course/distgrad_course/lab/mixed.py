"""The mixed-precision lab (lesson 04): policy, tolerances, overflowing data, the fixed recipe.

`mixed_precision_fit` is lesson 04's fix run as `model.fit` under `mixed_float16`:
`distgrad.mixed_precision.AllReplicasFiniteLossScaleOptimizer` (or another wrapper)
around `distgrad.AccumulatingOptimizer`, read micro-batch by micro-batch.
`overflow_data` makes one chosen micro-batch overflow float16 on chosen replicas.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import numpy as np

from distgrad_course.lab.compare import weight_diff, weights_of
from distgrad_course.lab.data import regression_data, tiny_model

# A target this far from the data makes the scaled gradient of its example exceed
# float16's largest finite value (65504) at any loss scale >= 1, while the float32
# loss stays finite: an overflow caused by loss scaling, not by the forward pass.
OUTLIER_TARGET = 1.0e4
# float16 stores 10 of its 11 significant bits: rounding to nearest is off by at most
# u = 2**-11 of the exact value (its unit roundoff; float32's is 2**-24).
FLOAT16_UNIT_ROUNDOFF = 2.0**-11
# The course's mixed-precision model: `tiny_model`, 4 features -> 8 tanh units -> 1 output.
TINY_MODEL_WIDTHS = (4, 8, 1)


def float16_rtol(roundings: int) -> float:
    """How far apart two float16 computations of the same value can land, relative to the
    magnitudes involved, when each rounds at most `roundings` times in sequence, in any
    order (another kernel, another summation order, a fused op): twice gamma_n =
    n*u / (1 - n*u), u = 2**-11 (Higham, *Accuracy and Stability of Numerical Algorithms*,
    2nd ed., Lemma 3.1). ValueError unless 0 < n*u < 1."""
    nu = roundings * FLOAT16_UNIT_ROUNDOFF
    if not 0 < nu < 1:
        raise ValueError(f"roundings must be between 1 and {2**11 - 1}, got {roundings}.")
    return 2 * nu / (1 - nu)


def step_roundings(batch: int, widths=TINY_MODEL_WIDTHS) -> int:
    """The longest chain of float16 roundings in one gradient of an MLP with these layer
    `widths` (tanh hidden layers), from the input to a kernel gradient, on `batch` examples
    summed by one replica: forward, per layer, a dot product of fan-in terms, the bias and
    the activation; the loss gradient cast to float16 and scaled; backward, per hidden
    layer, the input gradient (a dot product of fan-out terms) and the activation's
    derivative (two ops); then the kernel gradient's sum over the batch. Counted as if
    every sum rounded after each term (float16 accumulation, which AVX512-FP16 kernels
    may do); kernels that accumulate in float32 round less."""
    forward = sum(fan_in + 2 for fan_in in widths[:-1])
    backward = 2 + sum(fan_out + 2 for fan_out in widths[2:]) + batch
    return forward + backward


def _float16_ratios(actual, expected, initial):
    # Per weight: how far the two changes from `initial` are apart, over the larger change.
    ratios = []
    for a, e, i in zip(actual, expected, initial):
        a, e, i = (np.asarray(w, np.float64) for w in (a, e, i))
        change = max(np.abs(a - i).max(initial=0.0), np.abs(e - i).max(initial=0.0))
        apart = np.abs(a - e).max(initial=0.0)
        ratios.append(0.0 if apart == 0.0 else apart / change if change else np.inf)
    return ratios


def check_float16_close(actual, expected, initial, batch: int, what: str = "weights",
                        widths=TINY_MODEL_WIDTHS):
    """Assert two float16 trainings from the same `initial` weights made the same updates
    up to float16 rounding: for every weight, the largest difference of the two is at
    most `float16_rtol(step_roundings(batch, widths))` of the largest change either made.
    `batch` is the most examples one replica sums in one float16 gradient, in either run;
    `widths` are the model's layer widths (`step_roundings`).

    Norm-wise, per weight: float16's bound is relative to the magnitudes summed, so an
    element that cancels to near zero may be off by more than itself. Returns the
    `WeightDiff` of the weights, for printing."""
    rtol = float16_rtol(step_roundings(batch, widths))
    ratios = _float16_ratios(actual, expected, initial)
    if max(ratios) > rtol:
        raise AssertionError(
            f"{what} differ by more than float16 rounding: {max(ratios):.3e} of the largest "
            f"change, over the float16 bound {rtol:.3e} (batch {batch}).")
    return weight_diff(actual, expected)


def check_float16_apart(actual, expected, initial, batch: int, what: str = "weights",
                        widths=TINY_MODEL_WIDTHS):
    """Assert the opposite of `check_float16_close`: some weight's two changes differ by
    more than float16 rounding explains (a pitfall must make a real difference)."""
    rtol = float16_rtol(step_roundings(batch, widths))
    ratios = _float16_ratios(actual, expected, initial)
    if max(ratios) <= rtol:
        raise AssertionError(
            f"{what} agree within float16 rounding ({max(ratios):.3e} of the largest change, "
            f"bound {rtol:.3e}): no real difference.")
    return weight_diff(actual, expected)


# Keras' default initial loss scale. It is meant to overflow in the first steps (a
# scale that is too high costs a skipped step; one that is too low loses gradients),
# and on 1 replica it does so on this lesson's data. Controlled experiments start
# lower, so that the only overflow is the one they inject.
DEFAULT_INITIAL_SCALE = 2.0**15
CONTROLLED_INITIAL_SCALE = 2.0**10


@contextlib.contextmanager
def mixed_precision_policy(name: str = "mixed_float16"):
    """Set the global Keras dtype policy for the block, and restore the previous one."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def overflow_data(micro_batches: int, global_batch: int, overflow_step: int | None = None,
                  replicas: int = 1, overflow_replicas=None, seed: int = 0):
    """`(x, y)` for `micro_batches` micro-batches of `global_batch` examples.

    With `overflow_step` (1-based), one example in the shard of each replica in
    `overflow_replicas` (default: all) of that micro-batch gets the target
    `OUTLIER_TARGET`, so its scaled gradient overflows float16. Model.fit's
    distributed dataset gives replica r the r-th contiguous slice of each global batch.
    Raises ValueError for an indivisible batch, or a step or replica out of range.
    """
    if global_batch % replicas:
        raise ValueError(f"global_batch {global_batch} is not divisible by {replicas} replicas.")
    if overflow_step is not None and not 1 <= overflow_step <= micro_batches:
        raise ValueError(f"overflow_step must be in 1..{micro_batches}, got {overflow_step}.")
    x, y = regression_data(micro_batches * global_batch, seed=seed)
    if overflow_step is not None:
        shard = global_batch // replicas
        chosen = range(replicas) if overflow_replicas is None else overflow_replicas
        for r in chosen:
            if not 0 <= r < replicas:
                raise ValueError(f"replica {r} out of range for {replicas} replicas.")
            y[(overflow_step - 1) * global_batch + r * shard] = OUTLIER_TARGET
    return x, y


@dataclasses.dataclass(frozen=True)
class MixedFitRecord:
    """A mixed_float16 `model.fit`, micro-batch by micro-batch.

    `wrapper` / `wrapped` are the class names of `model.optimizer` and of what it
    wraps; `loss_scales[t]`, `iterations[t]` (updates), `total_micro_steps[t]`
    (micro-batches accumulated so far; = iterations without accumulation) and
    `weights_finite[t]` are read after micro-batch t+1; `accumulator_dtypes` and
    `skipped_updates` (cycles `AccumulatingOptimizer` dropped as non-finite, at the end)
    are None without accumulation; `skipped_micro_batches` are the steps the loss-scale
    wrapper skipped (distgrad's `skipped_steps`; for Keras' own around an
    `AccumulatingOptimizer` on one replica, the latter's count of them), None otherwise.
    """

    replicas: int
    wrapper: str
    wrapped: str
    loss_scales: tuple[float, ...]
    iterations: tuple[int, ...]
    total_micro_steps: tuple[int, ...]
    weights_finite: tuple[bool, ...]
    accumulator_dtypes: tuple[str, ...] | None
    skipped_updates: int | None
    initial_weights: list
    final_weights: list
    skipped_micro_batches: int | None = None


class LossScaleTrajectory(keras.callbacks.Callback):
    """Reads `model.fit` under a loss-scale optimizer after every micro-batch.

    `scales` (`dynamic_scale`), `iterations` (updates), `total_micro_steps` (the inner
    optimizer's, or `iterations` if it has none), `weight_changes` (max |dw| over all
    weights since the previous micro-batch; nan once weights are non-finite) and
    `weights_finite`, one entry per micro-batch.
    """

    def __init__(self):
        super().__init__()
        self.scales, self.iterations, self.total_micro_steps = [], [], []
        self.weight_changes, self.weights_finite = [], []
        self.previous = None

    def on_train_begin(self, logs=None):
        self.previous = weights_of(self.model)

    def on_train_batch_end(self, batch, logs=None):
        optimizer, now = self.model.optimizer, weights_of(self.model)
        with np.errstate(invalid="ignore"):  # inf - inf once weights are non-finite
            self.weight_changes.append(max(float(np.max(np.abs(a.astype(np.float64) - b)))
                                           for a, b in zip(now, self.previous)))
        self.previous = now
        self.scales.append(float(optimizer.dynamic_scale.numpy()))
        self.iterations.append(int(optimizer.iterations.numpy()))
        counter = getattr(optimizer.inner_optimizer, "total_micro_steps", optimizer.iterations)
        self.total_micro_steps.append(int(counter.numpy()))
        self.weights_finite.append(all(np.all(np.isfinite(w)) for w in now))


def mixed_precision_fit(strategy, x, y, batch_size: int, accumulation_steps: int | None = 2,
                        optimizer_factory=None, wrapper=None,
                        initial_scale: float | None = CONTROLLED_INITIAL_SCALE,
                        dynamic_growth_steps: int = 2000,
                        non_finite: str | None = None) -> MixedFitRecord:
    """`model.fit(x, y, batch_size)` of `tiny_model` under `mixed_float16` (shuffle off,
    one epoch).

    The optimizer is `optimizer_factory()` (default `SGD(0.1)`), wrapped in
    `distgrad.AccumulatingOptimizer(..., accumulation_steps)` unless
    `accumulation_steps` is None. With `initial_scale=None` it is handed to
    `model.compile` as is, so Keras adds its own `LossScaleOptimizer` (default scale
    2**15; `AccumulatingOptimizer` counts its skips on one replica, and refuses it in
    `build` on several); otherwise it is
    wrapped here in `wrapper` (default distgrad's `AllReplicasFiniteLossScaleOptimizer`)
    with `initial_scale` and `dynamic_growth_steps`. `non_finite` is passed to
    `AccumulatingOptimizer` when given (None: its default).
    """
    from distgrad.mixed_precision import AllReplicasFiniteLossScaleOptimizer
    from distgrad.optimizer import AccumulatingOptimizer

    optimizer_factory = optimizer_factory or (lambda: keras.optimizers.SGD(0.1))
    with mixed_precision_policy("mixed_float16"):
        with strategy.scope():
            model = tiny_model()
            optimizer = optimizer_factory()
            if accumulation_steps is not None:
                policy = {} if non_finite is None else {"non_finite": non_finite}
                optimizer = AccumulatingOptimizer(optimizer, accumulation_steps=accumulation_steps,
                                                  **policy)
            if initial_scale is not None:
                wrapper_class = wrapper or AllReplicasFiniteLossScaleOptimizer
                optimizer = wrapper_class(optimizer, initial_scale=initial_scale,
                                          dynamic_growth_steps=dynamic_growth_steps)
            model.compile(optimizer=optimizer, loss="mse")
        initial = weights_of(model)
        trajectory = LossScaleTrajectory()
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
                  callbacks=[trajectory])
    wrapped = model.optimizer.inner_optimizer
    dtypes = skipped = None
    micro_skips = getattr(model.optimizer, "skipped_steps",
                          getattr(wrapped, "skipped_micro_batches", None))
    if accumulation_steps is not None:
        dtypes = tuple(a.dtype for a in wrapped.accumulators)
        skipped = int(np.asarray(wrapped.skipped_updates))
    return MixedFitRecord(
        replicas=strategy.num_replicas_in_sync, wrapper=type(model.optimizer).__name__,
        wrapped=type(wrapped).__name__, loss_scales=tuple(trajectory.scales),
        iterations=tuple(trajectory.iterations),
        total_micro_steps=tuple(trajectory.total_micro_steps),
        weights_finite=tuple(trajectory.weights_finite), accumulator_dtypes=dtypes,
        skipped_updates=skipped,
        initial_weights=initial, final_weights=weights_of(model),
        skipped_micro_batches=None if micro_skips is None else int(np.asarray(micro_skips)))
