"""Pitfall: letting the optimizer create its slots inside the traced apply function.

On TF 2.21 / Keras 3.15, under MirroredStrategy with 2+ replicas, a `tf.function`
whose first call runs `strategy.run(... optimizer.apply_gradients ...)` with an
optimizer that is not built yet fails with
`InvalidArgumentError: You must feed a value for placeholder tensor
'cond/else/_1/cond/Placeholder...' with dtype int32` when the optimizer has slot
variables (SGD with momentum, Adam); plain SGD (no slots) and one replica run.

Why, read from the installed source:

1. `apply_gradients` builds the optimizer on first use; the slots are created while
   the function is being traced (`keras/src/optimizers/base_optimizer.py`, `apply`).
2. A `tf.function` that creates variables on its first call tries to lift their
   initializers out of the graph
   (`tensorflow/python/eager/polymorphic_function/polymorphic_function.py`,
   `Function._call` -> `_initialize_uninitialized_variables`). MirroredStrategy
   initializes replica i > 0's copy by *reading the primary copy*
   (`mirrored_strategy.py`, `_get_variable_creator_initial_value`), and inside the
   function that read sits behind `cond(is_initialized)`: the lift fails
   (`UnliftableError`), and TF falls back to `fn_with_cond`, which calls the traced
   function inside a `cond`.
3. The gradient all-reduce's instance keys are *call-time* captures: int32
   placeholders fed when the function is called
   (`cross_device_utils.py`, `CollectiveReplicaLauncher._next_instance_key`,
   `graph.capture_call_time_value`; its comment: "capture_call_time_value doesn't
   automatically propagate the deferred capture to the outer function"). Inside the
   `fn_with_cond` wrapper nobody feeds them: the error.

Reported as keras-team/keras#23085; fixed upstream by keras-team/keras#23087 (optimizer
variables created under `tf.init_scope()`), which the installed Keras 3.15.1 does not
have. The fix here: `optimizer.build(variables)` under `strategy.scope()` before
tracing, which `GradientAccumulator.make_apply_step` does for you.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from distgrad.accumulator import GradientAccumulator
from distgrad_course.lab.accumulation import plan_micro_batches, update_loss
from distgrad_course.lab.compare import OPTIMIZERS, WeightDiff, weight_diff
from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model
from distgrad_course.lab.recipes import big_batch_reference
from distgrad_course.pitfalls import CapturedError


@dataclasses.dataclass(frozen=True)
class LazySlotRecord:
    """`lazy_error`: what the lazily-building apply raised (None if it ran);
    `built_first_vs_big_batch`: the fix (build first) against one big-batch step;
    `call_time_int32_inputs`: int32 placeholders the traced apply is fed at call time
    (the collective instance keys)."""

    replicas: int
    optimizer: str
    lazy_error: CapturedError | None
    built_first_vs_big_batch: WeightDiff
    call_time_int32_inputs: int


def _accumulated_setup(strategy, optimizer_name, x, y):
    with strategy.scope():
        model = tiny_model()
        optimizer = OPTIMIZERS[optimizer_name]()
        accumulator = GradientAccumulator(model.trainable_variables)
    plan = plan_micro_batches(len(x), 1, strategy.num_replicas_in_sync)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x)))))

    def replica_accumulate(xb, yb):
        with tf.GradientTape() as tape:
            loss = update_loss(per_example_squared_error(yb, model(xb, training=True)), plan)
        accumulator.add(tape.gradient(loss, model.trainable_variables))

    tf.function(lambda b: strategy.run(replica_accumulate, args=b))(batch)
    return model, optimizer, accumulator


def reproduce(strategy, optimizer_name: str = "adam", examples: int = 16) -> LazySlotRecord:
    """Accumulate one micro-batch, then apply (a) lazily, (b) after `optimizer.build`."""
    if optimizer_name not in OPTIMIZERS:
        raise ValueError(f"optimizer_name must be one of {sorted(OPTIMIZERS)}.")
    x, y = regression_data(examples)

    model, optimizer, accumulator = _accumulated_setup(strategy, optimizer_name, x, y)

    @tf.function
    def lazy_apply():
        # The optimizer is not built: its slots get created while this is traced.
        strategy.run(accumulator.apply_gradients, args=(optimizer,))

    try:
        lazy_apply()
        lazy_error = None
    except tf.errors.InvalidArgumentError as err:
        lazy_error = CapturedError.of(err)

    model, optimizer, accumulator = _accumulated_setup(strategy, optimizer_name, x, y)
    apply_step = accumulator.make_apply_step(optimizer)  # builds under the scope first
    apply_step()
    graph = apply_step.function.get_concrete_function().graph
    call_time = [t for t in graph.deferred_internal_captures if t.dtype == tf.int32]
    reference = big_batch_reference(OPTIMIZERS[optimizer_name], x, y)
    return LazySlotRecord(
        replicas=strategy.num_replicas_in_sync,
        optimizer=optimizer_name,
        lazy_error=lazy_error,
        built_first_vs_big_batch=weight_diff([v.numpy() for v in model.weights], reference),
        call_time_int32_inputs=len(call_time),
    )
