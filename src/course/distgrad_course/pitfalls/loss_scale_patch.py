"""Pitfall: monkey-patching `apply_gradients` for accumulation under `mixed_float16`.

The question (tensorflow/tensorflow#50454, "assign_add() not working on GPU?") patched
an optimizer's `apply_gradients` with an accumulator that always calls the original
with `accumulated * apply` (apply = 0 or 1) and resets with `accumulated * keep`
(keep = 1 - apply). Under `mixed_float16` the optimizer was a `LossScaleOptimizer`;
patching it "did nothing", and patching its `inner_optimizer` "does not work either".
`distgrad_course.pitfalls.question_mask_patch.QuestionMaskPatch` is that accumulator as posted
(lesson 03 shows it is no accumulation for stateful optimizers).

What actually happens (read from the installed source, shown by `spy_patched_fit`
and `reproduce`):

* Patching the **LossScaleOptimizer instance** *does* accumulate. In Keras 3 the
  patch sits between the train step and `LossScaleOptimizer.apply`, so it accumulates
  **scaled** float32 gradients (`TensorFlowTrainer.train_step` multiplies the loss by
  `optimizer.scale_loss`; the wrapper divides by `dynamic_scale` later, in
  `_stateful_handle_finite_grads`). The failure comes with the first overflow, which
  dynamic loss scaling *expects* (it starts at 2**15 and halves on overflow): the
  non-finite micro-batch is added into the accumulator, the reset `accumulated * keep`
  is `inf * 0 = nan`, and from then on every call hands the wrapper a non-finite
  gradient. The wrapper skips every step and halves the scale every step; the weights
  never move again. `assign(grad)` instead of `assign_add` overwrites the poison each
  step, which is why the question's "assign" run converged.
* Patching **`inner_optimizer.apply_gradients`** is dead code in Keras 3:
  `LossScaleOptimizer._stateful_handle_finite_grads` calls `inner_optimizer.apply(...)`,
  never `apply_gradients`, so the patch never runs and training is plain
  non-accumulating training. (In tf-keras the wrapper does call
  `inner_optimizer.apply_gradients`; `tf_keras_reproduction` runs the question's own
  train_step there, `distgrad_course.pitfalls.tf_keras_loss_scale`, in a tf-keras child.)

Both variants also count micro-steps as optimizer iterations and let the loss scale
change inside an accumulation window. The correct composition is lesson 04's fix.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad_course.lab.compare import weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.mixed import (
    CONTROLLED_INITIAL_SCALE,
    DEFAULT_INITIAL_SCALE,
    LossScaleTrajectory,
    mixed_precision_policy,
    overflow_data,
)
from distgrad_course.lab.spy import GradientSpy, SpyRecord, flat
from distgrad_course.lab.tf_keras_runner import run_tf_keras
from distgrad_course.pitfalls import CapturedError
from distgrad_course.pitfalls.mask_trick import check_steps
from distgrad_course.pitfalls.question_mask_patch import QuestionMaskPatch

TARGETS = ("loss_scale_optimizer", "inner_optimizer", "none")
GENERATIONS = ("legacy", "v3")


def patch_optimizer(optimizer, n: int, trainable_variables, target: str = "loss_scale_optimizer"):
    """Install a `QuestionMaskPatch` the way the question did; returns the patch.

    `target="loss_scale_optimizer"` replaces `optimizer.apply_gradients` on the
    wrapper instance; `"inner_optimizer"` replaces `optimizer.inner_optimizer.
    apply_gradients`. Raises ValueError for another target or an `n` that is not an
    integer >= 1, and TypeError when `optimizer` is not a
    `keras.mixed_precision.LossScaleOptimizer`. Lesson 04 writes the same installation
    in its own cells and passes it as `install=` to the functions below.
    """
    if target not in TARGETS[:2]:
        raise ValueError(f"target must be one of {TARGETS[:2]}, got {target!r}.")
    if not isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        raise TypeError(
            "patch_optimizer expects a keras.mixed_precision.LossScaleOptimizer (wrap the "
            f"optimizer first), got {type(optimizer).__name__}.")
    patched = optimizer if target == "loss_scale_optimizer" else optimizer.inner_optimizer
    patch = QuestionMaskPatch(check_steps(n), patched.apply_gradients, trainable_variables)
    patched.apply_gradients = patch.apply_gradients
    return patch


# --- the call spy: which methods run, where, on which gradients ----------------------------


# (module, class, method, how to find the gradients in the call's arguments)
SPIED_METHODS = (
    ("distgrad_course.pitfalls.question_mask_patch", "QuestionMaskPatch", "apply_gradients",
     "pairs"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply_gradients", "pairs"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer", "apply", "list"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer", "check_finite", "list"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer",
     "_stateful_handle_finite_grads", "list"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer",
     "_stateful_handle_non_finite_grads", "none"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply", "list"),
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer", "_all_reduce_sum_gradients",
     "pairs+result"),
    ("keras.src.optimizers.sgd", "SGD", "update_step", "single"),
)


def compile_patched(strategy, target, accumulation_steps, learning_rate, wrapper=None,
                    initial_scale=DEFAULT_INITIAL_SCALE, install=None):
    """A `tiny_model` compiled with `wrapper(SGD)` (default Keras' LossScaleOptimizer),
    the question's patch on `target` ("none": no patch) installed by
    `install(optimizer, n, trainable_variables, target)` (default `patch_optimizer`);
    returns (model, optimizer, patch or None). Call under a mixed_float16 policy."""
    install = install or patch_optimizer
    wrapper = wrapper or keras.mixed_precision.LossScaleOptimizer
    with strategy.scope():
        model = tiny_model()
        model.build((None, 4))
        optimizer = wrapper(keras.optimizers.SGD(learning_rate), initial_scale=initial_scale)
        patch = None
        if target != "none":
            patch = install(optimizer, accumulation_steps, model.trainable_variables, target)
        model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer, patch


def _local_reference_gradient(x_shard, y_shard, replicas):
    """float32 gradient of (mean squared error over one replica's shard) / replicas at
    the initial weights: what one replica contributes before the all-reduce."""
    model = tiny_model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x_shard) - y_shard)) / replicas
    return flat([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])


def spy_patched_fit(strategy, target: str, accumulation_steps: int = 2,
                    micro_batch_per_replica: int = 4, install=None) -> SpyRecord:
    """Run `accumulation_steps` micro-batches of `model.fit` under `mixed_float16` with
    the question's patch on `target`, and record every executed spied call.

    To make "which gradient does this method receive" a single number, every replica
    and every micro-batch gets the *same* examples, and the learning rate is 0 (the
    weights never change). `scale_seen` is then the least-squares ratio of the passed
    gradient to one replica's float32 unscaled contribution `g`: about `loss_scale` for
    scaled partial gradients, 1 for unscaled ones, `k * loss_scale` for k accumulated
    scaled ones, `replicas` after the SUM all-reduce, 0 for the zeroed "don't apply"
    calls. The data are small enough that no micro-batch overflows. `install` as in
    `compile_patched`.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}.")
    replicas = strategy.num_replicas_in_sync
    x, y = regression_data(micro_batch_per_replica)
    reference = _local_reference_gradient(x, y, replicas)
    xs = np.tile(x, (replicas * accumulation_steps, 1))
    ys = np.tile(y, (replicas * accumulation_steps, 1))
    spy = GradientSpy(SPIED_METHODS, reference)

    class StepCounter(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            spy.step = batch + 1

    with mixed_precision_policy("mixed_float16"), spy.installed():
        model, optimizer, _ = compile_patched(strategy, target, accumulation_steps, 0.0,
                                              install=install)
        model.fit(xs, ys, batch_size=replicas * micro_batch_per_replica, epochs=1,
                  shuffle=False, verbose=0, callbacks=[StepCounter()])
    scale = float(optimizer.dynamic_scale.numpy())
    if scale != DEFAULT_INITIAL_SCALE:
        raise AssertionError(f"a spied micro-batch overflowed (loss scale now {scale}); "
                             "the ratios assume none does.")
    return spy.record()


# --- the outcome: graph-mode model.fit, step by step ---------------------------------------


@dataclasses.dataclass(frozen=True)
class PatchedFitOutcome:
    """What a patched `model.fit` did to the weights, micro-batch by micro-batch.

    `loss_scales[t]`, `iterations[t]` and `weight_changes[t]` (max |Δw| over all
    weights) are read after micro-batch t+1. `patch_calls` is how often the patched
    `apply_gradients` ran (None without a patch), `accumulators_finite` whether every
    replica's accumulator copy is finite at the end (None without a patch).
    """

    patch_calls: int | None
    loss_scales: tuple[float, ...]
    iterations: tuple[int, ...]
    weight_changes: tuple[float, ...]
    accumulators_finite: bool | None
    weights_finite: bool
    initial_weights: list
    final_weights: list


@dataclasses.dataclass(frozen=True)
class PatchedFitRecord(PatchedFitOutcome):
    """`reproduce`'s outcome (Keras 3), with the run's settings, and
    `accumulator_states[t]`: "nan" if any copy of the patch's accumulators holds a nan
    after micro-batch t+1, else "inf" if any holds an inf, else "finite" (None without
    a patch)."""

    target: str
    replicas: int
    accumulation_steps: int
    overflow_step: int | None
    accumulator_states: tuple[str, ...] | None


def accumulator_state(strategy, accumulators) -> str:
    """"nan", "inf" or "finite": the worst value in any replica's copy of `accumulators`."""
    copies = [np.asarray(c) for v in accumulators for c in strategy.experimental_local_results(v)]
    if any(np.isnan(c).any() for c in copies):
        return "nan"
    return "inf" if any(np.isinf(c).any() for c in copies) else "finite"


class _AccumulatorStates(keras.callbacks.Callback):
    def __init__(self, strategy, patch):
        super().__init__()
        self.strategy, self.patch, self.states = strategy, patch, []

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(accumulator_state(self.strategy, self.patch.accu_gradients))


def reproduce(strategy, target: str = "loss_scale_optimizer", micro_batches: int = 6,
              accumulation_steps: int = 2, overflow_step: int | None = 1,
              micro_batch_per_replica: int = 4, learning_rate: float = 0.1,
              overflow_replicas=None, wrapper=None,
              initial_scale: float = CONTROLLED_INITIAL_SCALE, install=None) -> PatchedFitRecord:
    """Graph-mode `model.fit` under `mixed_float16` with the question's patch on `target`
    ("none": the stock wrapper, no patch, no accumulation); one micro-batch per step,
    shuffle off. `overflow_step` puts an overflowing example into the shard of every
    replica in `overflow_replicas` (default: all) of that micro-batch (None: no
    overflow). `wrapper` is the loss-scale optimizer class (default Keras' own),
    `initial_scale` its initial loss scale, `install` as in `compile_patched`."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}.")
    replicas = strategy.num_replicas_in_sync
    global_batch = replicas * micro_batch_per_replica
    x, y = overflow_data(micro_batches, global_batch, overflow_step, replicas,
                         overflow_replicas)
    with mixed_precision_policy("mixed_float16"):
        model, _, patch = compile_patched(strategy, target, accumulation_steps, learning_rate,
                                          wrapper=wrapper, initial_scale=initial_scale,
                                          install=install)
        initial = weights_of(model)
        trajectory = LossScaleTrajectory()
        callbacks = [trajectory]
        if patch is not None:
            states = _AccumulatorStates(strategy, patch)
            callbacks.append(states)
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
    final = weights_of(model)
    accumulators_finite = None
    if patch is not None:
        accumulators_finite = accumulator_state(strategy, patch.accu_gradients) == "finite"
    return PatchedFitRecord(
        target=target, replicas=replicas, accumulation_steps=accumulation_steps,
        overflow_step=overflow_step,
        accumulator_states=None if patch is None else tuple(states.states),
        patch_calls=None if patch is None else int(patch.calls.numpy()),
        loss_scales=tuple(trajectory.scales), iterations=tuple(trajectory.iterations),
        weight_changes=tuple(trajectory.weight_changes),
        accumulators_finite=accumulators_finite,
        weights_finite=all(np.all(np.isfinite(w)) for w in final),
        initial_weights=initial, final_weights=final,
    )


def accumulated_reference(strategy, micro_batches: int = 6, accumulation_steps: int = 2,
                          micro_batch_per_replica: int = 4, learning_rate: float = 0.1,
                          initial_scale: float = CONTROLLED_INITIAL_SCALE):
    """What the question's patch means to compute, under `mixed_float16`: the stock
    wrapper on batches `accumulation_steps` times larger with the learning rate times
    `accumulation_steps` (the patch *sums* micro-batch gradients, each of which is a
    mean). Returns the final weights. No overflow."""
    replicas = strategy.num_replicas_in_sync
    global_batch = replicas * micro_batch_per_replica
    x, y = overflow_data(micro_batches, global_batch, None, replicas)
    # The gradient sum over replicas does not depend on which replica holds which
    # example, so consecutive micro-batches simply become one big batch.
    with mixed_precision_policy("mixed_float16"):
        model, _, _ = compile_patched(strategy, "none", accumulation_steps,
                                      learning_rate * accumulation_steps,
                                      initial_scale=initial_scale)
        model.fit(x, y, batch_size=global_batch * accumulation_steps, epochs=1,
                  shuffle=False, verbose=0)
    return weights_of(model)


# --- the original: tf-keras, the question's own train_step, in a child process -------------


@dataclasses.dataclass(frozen=True)
class LegacyScenario:
    """One tf-keras `model.fit` to run: optimizer generation ("legacy" = the question's
    era `OptimizerV2`, wrapped by `LossScaleOptimizer`; "v3" = tf-keras' newer
    optimizer, wrapped by `LossScaleOptimizerV3`), patch target, and overflow."""

    name: str
    generation: str = "legacy"
    target: str = "loss_scale_optimizer"
    overflow_step: int | None = None
    overflow_replicas: tuple[int, ...] | None = None
    accumulate_in_batch: bool = False  # True: one step on batches k times larger, lr * k
    patch_returns_result: bool = False  # True: the patch returns what the original returned


@dataclasses.dataclass(frozen=True)
class LegacyRecord(PatchedFitOutcome):
    """What one scenario did under tf-keras: the outcome, the wrapper's and the inner
    optimizer's class, the exception `model.fit` raised (`error`, None if none), and
    what the patched `apply_gradients` received while being traced (`patch_traces`:
    context, extra args, kwarg names)."""

    name: str
    error: CapturedError | None
    lso_class: str
    inner_class: str
    patch_traces: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class LegacyReproduction:
    tensorflow: str
    tf_keras: str
    replicas: int
    seconds: float
    records: dict[str, LegacyRecord]

    def __getitem__(self, name: str) -> LegacyRecord:
        return self.records[name]


DEFAULT_LEGACY_SCENARIOS = (
    LegacyScenario("stock, overflow at 3", target="none", overflow_step=3),
    LegacyScenario("patch on LSO", target="loss_scale_optimizer"),
    LegacyScenario("patch on LSO, overflow at 3", target="loss_scale_optimizer", overflow_step=3),
    LegacyScenario("patch on inner", target="inner_optimizer"),
    LegacyScenario("patch on inner, overflow at 3", target="inner_optimizer", overflow_step=3),
    LegacyScenario("patch on inner, returning the result", target="inner_optimizer",
                   overflow_step=3, patch_returns_result=True),
    LegacyScenario("big batch", target="none", accumulate_in_batch=True),
    LegacyScenario("v3: patch on LSO, overflow at 3", generation="v3",
                   target="loss_scale_optimizer", overflow_step=3),
    LegacyScenario("v3: patch on inner", generation="v3", target="inner_optimizer"),
    LegacyScenario("v3: patch on inner, overflow at 3", generation="v3",
                   target="inner_optimizer", overflow_step=3),
    LegacyScenario("stock, overflow on replica 1 only", target="none", overflow_step=3,
                   overflow_replicas=(1,)),
)


def _nan_aware(values):
    return [np.asarray(v, dtype=np.float64) if not isinstance(v, str) else float(v)
            for v in values]


def tf_keras_reproduction(scenarios=DEFAULT_LEGACY_SCENARIOS, replicas: int = 2,
                        micro_batches: int = 6, accumulation_steps: int = 2,
                        micro_batch_per_replica: int = 4, learning_rate: float = 0.1,
                        initial_scale: float = CONTROLLED_INITIAL_SCALE,
                        timeout: float = 300) -> LegacyReproduction:
    """Run the question's train_step and patches under tf-keras 2.x, in one subprocess
    (`distgrad_course.lab.tf_keras_runner.run_tf_keras` of
    `distgrad_course.pitfalls.tf_keras_loss_scale`), on the
    same data layout as `reproduce`. Raises ValueError for an unknown generation or
    target (before the child starts).
    """
    global_batch = replicas * micro_batch_per_replica
    x, _ = overflow_data(micro_batches, global_batch, None, replicas)
    payload = []
    for s in scenarios:
        if s.generation not in GENERATIONS:
            raise ValueError(f"generation must be one of {GENERATIONS}, got {s.generation!r}.")
        if s.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {s.target!r}.")
        _, y = overflow_data(micro_batches, global_batch, s.overflow_step, replicas,
                             s.overflow_replicas)
        big = s.accumulate_in_batch
        payload.append({
            "name": s.name, "generation": s.generation, "target": s.target, "y": y.tolist(),
            "patch_returns_result": s.patch_returns_result,
            "batch_size": global_batch * (accumulation_steps if big else 1),
            "learning_rate": learning_rate * (accumulation_steps if big else 1)})
    result = run_tf_keras("distgrad_course.pitfalls.tf_keras_loss_scale:run_scenarios", replicas,
                        timeout=timeout, x=x.tolist(), scenarios=payload,
                        accumulation_steps=accumulation_steps, initial_scale=initial_scale)
    records = {}
    for r in result.value:
        records[r["name"]] = LegacyRecord(**{
            **r, "error": None if r["error"] is None else CapturedError(**r["error"]),
            **{k: tuple(r[k]) for k in ("loss_scales", "iterations", "patch_traces")},
            "weight_changes": tuple(float(c) for c in r["weight_changes"]),
            **{k: _nan_aware(r[k]) for k in ("initial_weights", "final_weights")}})
    return LegacyReproduction(result.tensorflow, result.tf_keras, result.replicas,
                              result.seconds, records)
