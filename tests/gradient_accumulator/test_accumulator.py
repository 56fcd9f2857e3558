"""Lesson 02's facts: GradientAccumulator in a custom loop under MirroredStrategy."""

import functools

import numpy as np
import pytest
import tensorflow as tf

from distgrad.accumulator import GradientAccumulator
from distgrad_course.lab.accumulation import (
    AccumulatedTrainer,
    full_batch_loss,
    plan_micro_batches,
    train_accumulated,
    update_loss,
)
from distgrad_course.lab.compare import (
    OPTIMIZERS,
    check_close,
    check_not_close,
    update_ratio,
    updates,
    weights_of,
)
from distgrad_course.lab.data import (
    embedding_model,
    per_example_squared_error,
    regression_data,
    tiny_model,
    token_data,
)
from distgrad_course.lab.recipes import big_batch_reference, dense_gradient_reference

EXAMPLES = 16
MODELS = {"mlp": (tiny_model, lambda: regression_data(EXAMPLES)),
          "embedding": (embedding_model, lambda: token_data(EXAMPLES))}


@functools.cache
def reference(model_name, optimizer_name, steps, dense=False):
    model_factory, data = MODELS[model_name]
    x, y = data()
    make = dense_gradient_reference if dense else big_batch_reference
    return make(OPTIMIZERS[optimizer_name], x, y, steps=steps, model_factory=model_factory)


# --- equivalence ----------------------------------------------------------------------


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_k_accumulated_micro_batches_equal_one_big_batch_step(strategy, k, optimizer_name):
    x, y = regression_data(EXAMPLES)
    run = train_accumulated(strategy, OPTIMIZERS[optimizer_name], x, y, k, updates=3)
    check_close(run.weights_per_update[0], reference("mlp", optimizer_name, 1),
                what="after 1 update")
    check_close(run.final, reference("mlp", optimizer_name, 3), what="after 3 updates")
    assert run.iterations == 3  # one optimizer step per update, not per micro-batch
    assert run.micro_steps_left == 0
    assert run.copies_agree


@pytest.mark.parametrize("optimizer_name", ["sgd", "momentum"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_embedding_sparse_gradients_accumulate_to_the_big_batch_step(strategy, k, optimizer_name):
    x, y = token_data(EXAMPLES)
    run = train_accumulated(strategy, OPTIMIZERS[optimizer_name], x, y, k, updates=3,
                            model_factory=embedding_model)
    # The reference gets the embedding gradient as IndexedSlices; SGD/momentum
    # arithmetic is the same on sparse and dense gradients.
    check_close(run.weights_per_update[0], reference("embedding", optimizer_name, 1))
    check_close(run.final, reference("embedding", optimizer_name, 3))
    assert run.iterations == 3


@pytest.mark.parametrize("k", [1, 2, 4])
def test_adam_with_embedding_equals_the_dense_gradient_big_batch_step(strategy, k):
    x, y = token_data(EXAMPLES)
    run = train_accumulated(strategy, OPTIMIZERS["adam"], x, y, k, updates=3,
                            model_factory=embedding_model)
    # Like with like: the accumulator hands Adam a dense gradient.
    check_close(run.weights_per_update[0], reference("embedding", "adam", 1, dense=True))
    check_close(run.final, reference("embedding", "adam", 3, dense=True))


def test_keras_adam_updates_differ_between_sparse_and_dense_embedding_gradients():
    # Why the Adam test compares against a dense reference (tokens repeat in a batch).
    diff = check_not_close(reference("embedding", "adam", 1),
                           reference("embedding", "adam", 1, dense=True))
    assert diff.max_abs > 1e-3


# --- communication ------------------------------------------------------------------------


def test_accumulating_is_local_and_the_update_costs_one_all_reduce(strategy2):
    x, y = regression_data(EXAMPLES)
    run = train_accumulated(strategy2, OPTIMIZERS["adam"], x, y, 4)
    assert run.accumulate.all_reduces == 0
    assert run.apply.all_reduces == 1
    assert run.all_reduces_per_update == 1


def test_applying_every_micro_step_costs_k_all_reduces_and_k_optimizer_steps(strategy2):
    x, y = regression_data(EXAMPLES)
    run = train_accumulated(strategy2, OPTIMIZERS["sgd"], x, y, 4, updates=2,
                            apply_every_micro_step=True)
    assert run.all_reduces_per_update == 4
    assert run.iterations == 8
    check_not_close(run.final, reference("mlp", "sgd", 2))


def test_one_replica_needs_no_all_reduce(strategy1):
    x, y = regression_data(EXAMPLES)
    run = train_accumulated(strategy1, OPTIMIZERS["sgd"], x, y, 2)
    assert run.all_reduces_per_update == 0


# --- loss scaling -------------------------------------------------------------------------


def test_reported_loss_of_an_update_is_the_full_batch_loss(strategy2):
    x, y = regression_data(EXAMPLES)
    run = train_accumulated(strategy2, OPTIMIZERS["sgd"], x, y, 4, updates=2)
    for reported, before in zip(run.reported_losses, run.losses):
        assert reported == pytest.approx(before, rel=1e-6)
    assert run.losses[0] == pytest.approx(full_batch_loss(tiny_model(), x, y), rel=1e-6)


@pytest.mark.parametrize("loss_scaling, expected_ratio", [
    ("update", lambda k, r: 1.0),
    ("micro_batch", lambda k, r: float(k)),
    ("per_replica_mean", lambda k, r: float(k * r)),
])
def test_loss_scaling_sets_the_sgd_update_size(strategy2, loss_scaling, expected_ratio):
    x, y = regression_data(EXAMPLES)
    run = train_accumulated(strategy2, OPTIMIZERS["sgd"], x, y, 2, loss_scaling=loss_scaling)
    ratio = update_ratio(updates(run.final, run.initial),
                         updates(reference("mlp", "sgd", 1), run.initial))
    assert ratio == pytest.approx(expected_ratio(2, 2), rel=1e-6)


def test_update_loss_divides_by_the_global_batch_of_the_whole_update():
    plan = plan_micro_batches(16, 4, 2)
    assert (plan.global_micro_batch, plan.per_replica_micro_batch) == (4, 2)
    per_example = tf.constant([1.0, 3.0])
    assert float(update_loss(per_example, plan)) == pytest.approx(4.0 / 16)
    assert float(update_loss(per_example, plan, "micro_batch")) == pytest.approx(4.0 / 4)
    assert float(update_loss(per_example, plan, "per_replica_mean")) == pytest.approx(2.0)


# --- state: replica-local, dtypes, None, IndexedSlices, checkpoint ------------------------


def test_buffers_are_replica_local_and_read_as_their_sum_across_replicas(strategy2):
    with strategy2.scope():
        variable = tf.Variable(tf.zeros([3]))
        accumulator = GradientAccumulator([variable])

    def add_replica_id():
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        accumulator.add([tf.fill([3], replica + 1.0)])

    step = tf.function(lambda: strategy2.run(add_replica_id))
    step()
    step()
    buffer = accumulator.accumulated[0]
    assert type(buffer).__name__ == "SyncOnReadVariable"
    assert [v.numpy().tolist() for v in buffer.values] == [[2.0] * 3, [4.0] * 3]
    assert buffer.numpy().tolist() == [6.0] * 3  # cross-replica read: SUM
    assert accumulator.micro_steps == 2
    accumulator.reset()
    assert accumulator.micro_steps == 0
    assert [v.numpy().tolist() for v in buffer.values] == [[0.0] * 3, [0.0] * 3]


def test_summed_buffers_after_k_micro_steps_are_the_big_batch_mean_gradient(strategy2):
    x, y = regression_data(EXAMPLES)
    trainer = AccumulatedTrainer(strategy2, OPTIMIZERS["sgd"], x, y, 4)
    for j in range(4):
        trainer.accumulate_step(j)
    model = tiny_model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(per_example_squared_error(tf.constant(y), model(tf.constant(x))))
    mean_gradient = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    check_close([b.numpy() for b in trainer.accumulator.accumulated], mean_gradient)
    assert trainer.accumulator.micro_steps == 4


def test_aggregation_none_buffers_can_be_neither_read_nor_saved_across_replicas(strategy2,
                                                                              tmp_path):
    # Why the buffers use aggregation=SUM rather than OpenNMT-tf's NONE.
    with strategy2.scope():
        buffer = tf.Variable(tf.zeros([2]), trainable=False,
                             synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.NONE)
    fragment = "Could not convert from `tf.VariableAggregation`"
    with pytest.raises(ValueError, match=fragment):
        buffer.numpy()
    with pytest.raises(ValueError, match=fragment):
        tf.train.Checkpoint(buffer=buffer).write(str(tmp_path / "ckpt"))


def test_sync_on_read_variables_have_no_scatter_add(strategy2):
    with strategy2.scope():
        accumulator = GradientAccumulator([tf.Variable(tf.zeros([3]))])
    sparse = tf.IndexedSlices(tf.ones([1]), tf.constant([0]), tf.constant([3]))
    with pytest.raises(NotImplementedError, match="ON_READ` doesn't support `scatter_add`"):
        tf.function(lambda: strategy2.run(
            lambda: accumulator.accumulated[0].scatter_add(sparse)))()


def test_indexed_slices_with_repeated_rows_are_summed_densely(strategy1):
    with strategy1.scope():
        table = tf.Variable(tf.zeros([4, 2]))
        accumulator = GradientAccumulator([table])
    sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]]),
                              tf.constant([2, 0, 2]), tf.constant([4, 2]))
    tf.function(lambda: strategy1.run(lambda: accumulator.add([sparse])))()
    np.testing.assert_array_equal(accumulator.accumulated[0].numpy(),
                                  [[10, 20], [0, 0], [101, 202], [0, 0]])


def test_none_gradients_are_skipped_and_keep_their_position(strategy2):
    x, y = regression_data(EXAMPLES)
    with strategy2.scope():
        model = tiny_model()
        unused = tf.Variable(tf.ones([2]), name="unused")
        optimizer = OPTIMIZERS["momentum"]()
        variables = [*model.trainable_variables, unused]
        accumulator = GradientAccumulator(variables)
    batch = next(iter(strategy2.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(EXAMPLES))))

    def replica_accumulate(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                per_example_squared_error(yb, model(xb)), global_batch_size=EXAMPLES)
        grads = tape.gradient(loss, variables)
        assert grads[-1] is None
        accumulator.add(grads)

    tf.function(lambda b: strategy2.run(replica_accumulate, args=b))(batch)
    assert accumulator.gradients()[-1] is None
    accumulator.make_apply_step(optimizer)()
    check_close(weights_of(model), reference("mlp", "momentum", 1))
    assert unused.numpy().tolist() == [1.0, 1.0]


def test_buffers_are_float32_for_float16_and_bfloat16_variables(strategy1):
    with strategy1.scope():
        half = tf.Variable(tf.zeros([2], tf.float16))
        brain = tf.Variable(tf.zeros([2], tf.bfloat16))
        accumulator = GradientAccumulator([half, brain])
    assert [b.dtype for b in accumulator.accumulated] == [tf.float32, tf.float32]

    @tf.function
    def add_many(n):
        for _ in tf.range(n):
            strategy1.run(lambda: accumulator.add(
                [tf.fill([2], tf.constant(1e-3, tf.float16)),
                 tf.fill([2], tf.constant(1e-3, tf.bfloat16))]))

    add_many(tf.constant(1000))
    summed = accumulator.accumulated[1].numpy()
    increment = float(tf.constant(1e-3, tf.bfloat16).numpy())
    assert summed[0] == pytest.approx(1000 * increment, rel=1e-5)
    # the same sum kept in bfloat16 stalls far below
    naive = tf.constant(0.0, tf.bfloat16)
    for _ in range(1000):
        naive += tf.constant(1e-3, tf.bfloat16)
    assert float(naive.numpy()) < 0.75 * summed[0]
    assert [g.dtype for g in accumulator.gradients()] == [tf.float16, tf.bfloat16]


@pytest.mark.parametrize("optimizer_name", ["momentum", "adam"])
def test_checkpoint_mid_accumulation_restores_to_the_same_update(strategy, optimizer_name,
                                                                tmp_path):
    x, y = regression_data(EXAMPLES)
    k = 4
    first = AccumulatedTrainer(strategy, OPTIMIZERS[optimizer_name], x, y, k)
    first.update()  # optimizer state (slots, iterations) is non-trivial now
    first.accumulate_step(0)
    first.accumulate_step(1)
    path = first.checkpoint().save(str(tmp_path / "mid"))

    second = AccumulatedTrainer(strategy, OPTIMIZERS[optimizer_name], x, y, k)
    second.checkpoint().restore(path).assert_consumed()
    assert second.accumulator.micro_steps == 2
    assert int(second.optimizer.iterations.numpy()) == 1
    # The checkpoint keeps the SUM over replicas; each replica gets SUM / R back.
    restored = second.accumulator.accumulated[0]
    np.testing.assert_allclose(sum(v.numpy() for v in restored.values),
                               first.accumulator.accumulated[0].numpy(), rtol=1e-6, atol=1e-7)
    for trainer in (first, second):
        trainer.accumulate_step(2)
        trainer.accumulate_step(3)
        trainer.apply_step()
    check_close(weights_of(second.model), weights_of(first.model))
    check_close(weights_of(second.model), reference("mlp", optimizer_name, 2))
    assert int(second.optimizer.iterations.numpy()) == 2


# --- item 5: where optimizer state is created ----------------------------------------------


@pytest.mark.parametrize("k", [0, -1])
def test_accumulation_steps_below_one_are_rejected(k):
    with pytest.raises(ValueError, match="accumulation_steps must be an integer >= 1"):
        plan_micro_batches(16, k, 2)


def test_micro_batch_not_divisible_across_replicas_is_rejected(strategy2):
    x, y = regression_data(6)
    with pytest.raises(ValueError, match="micro-batch of 3 examples is not divisible across 2"):
        train_accumulated(strategy2, OPTIMIZERS["sgd"], x, y, 2)
    with pytest.raises(ValueError, match="not divisible into 4 equal micro-batches"):
        train_accumulated(strategy2, OPTIMIZERS["sgd"], x, y, 4)


def test_accumulator_created_outside_the_strategy_scope_is_rejected(strategy2):
    with strategy2.scope():
        model = tiny_model()
    with pytest.raises(ValueError, match="outside its scope"):
        GradientAccumulator(model.trainable_variables)


def test_accumulator_under_another_strategy_is_rejected(strategy2, strategy1):
    with strategy2.scope():
        model = tiny_model()
    with strategy1.scope(), pytest.raises(ValueError, match="belongs to another strategy"):
        GradientAccumulator(model.trainable_variables)


def test_model_built_outside_the_scope_is_rejected(strategy2):
    model = tiny_model()
    with strategy2.scope(), pytest.raises(ValueError, match="built outside `strategy.scope"):
        GradientAccumulator(model.trainable_variables)


def test_gradient_list_not_matching_the_variables_is_rejected(strategy2):
    with strategy2.scope():
        model = tiny_model()
        accumulator = GradientAccumulator(model.trainable_variables)
    grads = [tf.zeros_like(v) for v in model.trainable_variables[:-1]]
    with pytest.raises(ValueError, match="add\\(\\) got 3 gradients for 4 variables"):
        tf.function(lambda: strategy2.run(lambda: accumulator.add(grads)))()


def test_apply_with_zero_accumulated_micro_steps_is_rejected(strategy2):
    with strategy2.scope():
        model = tiny_model()
        optimizer = OPTIMIZERS["sgd"]()
        accumulator = GradientAccumulator(model.trainable_variables)
    apply_step = accumulator.make_apply_step(optimizer)
    with pytest.raises(ValueError, match="apply with zero accumulated micro-steps"):
        apply_step()
    # the traced function guards itself too, for loops that call it from a tf.function
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="apply with zero accumulated micro-steps"):
        apply_step.function()
    assert int(optimizer.iterations.numpy()) == 0  # nothing ran, not even the step count
    check_close(weights_of(model), weights_of(tiny_model()), rtol=0, atol=0)


def test_add_and_apply_outside_strategy_run_are_rejected(strategy2):
    with strategy2.scope():
        model = tiny_model()
        optimizer = OPTIMIZERS["sgd"]()
        accumulator = GradientAccumulator(model.trainable_variables)
        with pytest.raises(RuntimeError, match="inside `strategy.run"):
            accumulator.add([tf.zeros_like(v) for v in model.trainable_variables])
        with pytest.raises(RuntimeError, match="inside `strategy.run"):
            accumulator.apply_gradients(optimizer)


def test_optimizer_created_outside_the_scope_is_rejected(strategy2):
    with strategy2.scope():
        model = tiny_model()
        accumulator = GradientAccumulator(model.trainable_variables)
    with pytest.raises(ValueError, match="optimizer was created outside the strategy scope"):
        accumulator.make_apply_step(OPTIMIZERS["sgd"]())


def test_other_bad_arguments_are_rejected(strategy2):
    x, y = regression_data(EXAMPLES)
    with pytest.raises(ValueError, match="updates must be an integer >= 1"):
        train_accumulated(strategy2, OPTIMIZERS["sgd"], x, y, 2, updates=0)
    with pytest.raises(ValueError, match="loss_scaling must be one of"):
        train_accumulated(strategy2, OPTIMIZERS["sgd"], x, y, 2, loss_scaling="mean")
    with pytest.raises(ValueError, match="at least one variable"):
        GradientAccumulator([])
    with strategy2.scope(), pytest.raises(TypeError, match="int32 variable"):
        GradientAccumulator([tf.Variable(0)])


def test_without_any_strategy_the_accumulator_works_on_one_device():
    x, y = regression_data(EXAMPLES)
    model, optimizer = tiny_model(), OPTIMIZERS["momentum"]()
    accumulator = GradientAccumulator(model.trainable_variables)
    default = tf.distribute.get_strategy()

    def replica_accumulate(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                per_example_squared_error(yb, model(xb)), global_batch_size=EXAMPLES)
        accumulator.add(tape.gradient(loss, model.trainable_variables))

    accumulate = tf.function(lambda xb, yb: default.run(replica_accumulate, args=(xb, yb)))
    for half in (slice(0, EXAMPLES // 2), slice(EXAMPLES // 2, EXAMPLES)):
        accumulate(tf.constant(x[half]), tf.constant(y[half]))
    accumulator.make_apply_step(optimizer)()
    check_close(weights_of(model), reference("mlp", "momentum", 1))
