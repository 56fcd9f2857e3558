"""Pitfall: summing per-replica gradients in Python and applying them outside `strategy.run`.

The question's loop (`../shared/questions/002_...`): call `strategy.run` for each
micro-batch to get gradients, add them up in Python, call `apply_gradients` once.
What `strategy.run` returns in cross-replica context is a `PerReplica` value per
gradient (one tensor per device, `tensorflow/python/distribute/values.py`), not a
tensor, so

* `per_replica_a + per_replica_b` is a TypeError (PerReplica defines no `+`);
* `apply_gradients(PerReplica grads)` outside the strategy scope reaches
  `TFOptimizer._all_reduce_sum_gradients` in the *default* replica context, whose
  `all_reduce` cannot take a PerReplica (ValueError);
* under `strategy.scope()` (eager or traced) there is no replica context at all:
  `maybe_merge_call` (`tensorflow/python/distribute/merge_call_interim.py`) calls
  `get_replica_context().merge_call` on None (AttributeError);
* with tf.keras 2 (`tf_keras`, OptimizerV2) the same call raised the message the user
  quoted: "`apply_gradients() cannot be called in cross-replica context. Use
  `tf.distribute.Strategy.run` to enter replica context."

`reproduce_posted_answer` runs the posted answer as far as current TF lets it:
`strategy.experimental_run_v2` no longer exists (renamed `run` in TF 2.2,
tensorflow/tensorflow#37551; gone by TF 2.4, tensorflow/tensorflow#49187); with
`strategy.run`, summing `experimental_local_results` into accumulators created as
plain `tf.Variable`s under the scope (MirroredVariables) runs, but gathers every
replica's gradients onto one device at every micro-step;
the apply fails under the scope exactly like the question's, and *runs* outside it
(`DistributedVariable._update` enters the variable's own strategy,
`distribute_lib.enter_or_assert_strategy`), where, with the usual per-replica mean
loss, its `/ k` leaves an update R times too large.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from distgrad_course.lab.compare import update_ratio, updates, weights_of
from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model
from distgrad_course.lab.recipes import big_batch_reference
from distgrad_course.pitfalls import CapturedError


@dataclasses.dataclass(frozen=True)
class OutsideStrategyRunRecord:
    """Errors of the question's pattern on the installed TF/Keras."""

    replicas: int
    gradient_type: str
    sum_error: CapturedError
    apply_outside_scope_error: CapturedError
    apply_in_scope_error: CapturedError
    apply_in_traced_function_error: CapturedError


def _capture(fn) -> CapturedError | None:
    try:
        fn()
    except Exception as err:  # the point is to record what TF raises
        return CapturedError.of(err)
    return None


def _setup(strategy, optimizer_factory, examples):
    x, y = regression_data(examples)
    with strategy.scope():
        model = tiny_model()
        optimizer = optimizer_factory()
        optimizer.build(model.trainable_variables)
    return x, y, model, optimizer


def reproduce(strategy, examples: int = 16) -> OutsideStrategyRunRecord:
    """Run the question's loop over two micro-batches and record each error."""
    x, y, model, optimizer = _setup(strategy, lambda: keras.optimizers.SGD(0.1), examples)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(examples // 2)
    batches = list(strategy.experimental_distribute_dataset(dataset))

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_squared_error(yb, model(xb, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    gradients_of = tf.function(lambda batch: strategy.run(train_step, args=batch))
    per_replica = [gradients_of(batch) for batch in batches]
    first = per_replica[0]

    def apply(grads):
        return lambda: optimizer.apply_gradients(zip(grads, model.trainable_variables))

    def in_scope(fn):
        def run():
            with strategy.scope():
                fn()
        return run

    traced = tf.function(lambda batch: optimizer.apply_gradients(
        zip(strategy.run(train_step, args=batch), model.trainable_variables)))
    return OutsideStrategyRunRecord(
        replicas=strategy.num_replicas_in_sync,
        gradient_type=type(first[0]).__name__,
        sum_error=_capture(lambda: [a + b for a, b in zip(*per_replica)]),
        apply_outside_scope_error=_capture(apply(first)),
        apply_in_scope_error=_capture(in_scope(apply(first))),
        apply_in_traced_function_error=_capture(in_scope(lambda: traced(batches[0]))),
    )


def reproduce_tf_keras(replicas: int = 2) -> CapturedError:
    """The error tf.keras 2's OptimizerV2 raises for the same call, from a tf-keras child
    (`distgrad_course.lab.tf_keras_runner.run_tf_keras` of
    `distgrad_course.pitfalls.tf_keras_outside_strategy_run.apply_outside_run`); several seconds
    of TensorFlow start-up."""
    from distgrad_course.lab.tf_keras_runner import run_tf_keras

    result = run_tf_keras(
        "distgrad_course.pitfalls.tf_keras_outside_strategy_run:apply_outside_run", replicas)
    return CapturedError(result["type"], result["message"])


@dataclasses.dataclass(frozen=True)
class PostedAnswerRecord:
    """The posted answer on current TF, step by step.

    `accumulator_type`: what a plain `tf.Variable` under the scope becomes (one full
    copy per device, written from cross-replica context at every micro-step).
    `gradient_ratio`: accumulated / k vs the true big-batch gradient (least squares).
    `update_ratio_*`: SGD update vs one big-batch step, apply run outside the scope.
    """

    replicas: int
    accumulation_steps: int
    run_v2_error: CapturedError
    accumulator_type: str
    apply_in_scope_error: CapturedError
    gradient_ratio: float
    update_ratio_per_replica_mean: float
    update_ratio_global_micro_batch: float


def _posted_answer_run(strategy, x, y, accumulation_steps, loss_scaling, learning_rate):
    """Accumulate like the answer, then apply outside the scope (the variant that runs)."""
    k = accumulation_steps
    with strategy.scope():
        model = tiny_model()
        optimizer = keras.optimizers.SGD(learning_rate)
        optimizer.build(model.trainable_variables)
        # The answer's accumulators: plain tf.Variables, created under the scope.
        accumulators = [tf.Variable(tf.zeros_like(v), trainable=False)
                        for v in model.trainable_variables]
    initial = weights_of(model)
    global_micro_batch = len(x) // k
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_micro_batch)
    batches = list(strategy.experimental_distribute_dataset(dataset))

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            per_example = per_example_squared_error(yb, model(xb, training=True))
            if loss_scaling == "per_replica_mean":
                loss = tf.reduce_mean(per_example)
            else:
                loss = tf.nn.compute_average_loss(per_example,
                                                  global_batch_size=global_micro_batch)
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def train_step(batch):
        per_replica = strategy.run(step_fn, args=batch)
        for accumulator, grad in zip(accumulators, per_replica):
            # Cross-replica context: the replicas' gradients are copied to one device
            # and summed there, then written into every copy of the accumulator.
            accumulator.assign_add(tf.add_n(strategy.experimental_local_results(grad)))

    @tf.function
    def apply():
        optimizer.apply_gradients(zip([a / k for a in accumulators], model.trainable_variables))
        for accumulator in accumulators:
            accumulator.assign(tf.zeros_like(accumulator))

    for batch in batches:
        train_step(batch)
    accumulated = [a.numpy() / k for a in accumulators]
    apply_in_scope = None
    try:
        with strategy.scope():
            apply()
    except AttributeError as err:
        apply_in_scope = CapturedError.of(err)
    if apply_in_scope is not None:
        apply()  # outside the scope it runs
    return initial, accumulated, weights_of(model), apply_in_scope, accumulators


def reproduce_posted_answer(strategy, accumulation_steps: int = 2, examples: int = 16,
                            learning_rate: float = 0.1) -> PostedAnswerRecord:
    """Run the posted answer's approach with k micro-batches of `examples / k`."""
    run_v2_error = _capture(lambda: strategy.experimental_run_v2)
    x, y = regression_data(examples)

    def sgd():
        return keras.optimizers.SGD(learning_rate)

    reference = big_batch_reference(sgd, x, y)

    # The true big-batch mean gradient at the initial weights.
    model = tiny_model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example_squared_error(tf.constant(y), model(tf.constant(x))))
    true_gradient = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]

    initial, accumulated, final_mean, apply_in_scope, accumulators = _posted_answer_run(
        strategy, x, y, accumulation_steps, "per_replica_mean", learning_rate)
    _, _, final_global, _, _ = _posted_answer_run(
        strategy, x, y, accumulation_steps, "global_micro_batch", learning_rate)

    return PostedAnswerRecord(
        replicas=strategy.num_replicas_in_sync,
        accumulation_steps=accumulation_steps,
        run_v2_error=run_v2_error,
        accumulator_type=type(accumulators[0]).__name__,
        apply_in_scope_error=apply_in_scope,
        gradient_ratio=update_ratio(accumulated, true_gradient),
        update_ratio_per_replica_mean=update_ratio(updates(final_mean, initial),
                                                   updates(reference, initial)),
        update_ratio_global_micro_batch=update_ratio(updates(final_global, initial),
                                                     updates(reference, initial)),
    )
