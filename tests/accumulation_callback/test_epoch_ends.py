"""An incomplete cycle at the end of an epoch: carried on (the default), flushed or discarded.

Epochs of 5 micro-batches with k = 2: updates on micro-batches (1, 2) and (3, 4), and
micro-batch 5 left over. "carry": it pairs with the next epoch's first micro-batch.
"flush": it is applied alone, as its own mean. "discard": it is dropped. Each equals
plain one-device steps on the batches that choice implies.
"""

import numpy as np
import pytest
import tensorflow as tf

from distgrad.callbacks import AccumulationCallback
from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import OPTIMIZERS, check_close, weights_of
from distgrad_course.lab.data import per_example_squared_error, regression_data, tiny_model
from distgrad_course.lab.recipes import make_replica_step

K, MICRO, PER_EPOCH, EPOCHS = 2, 4, 5, 2
X, Y = regression_data(MICRO * PER_EPOCH)


def micro_batch(i):
    return X[i * MICRO:(i + 1) * MICRO], Y[i * MICRO:(i + 1) * MICRO]


def plain_steps(batches, optimizer_factory=OPTIMIZERS["adam"]):
    """One device, no strategy: one plain step per `(x, y)` batch, mean loss over it."""
    model, optimizer = tiny_model(), optimizer_factory()
    optimizer.build(model.trainable_variables)

    @tf.function(reduce_retracing=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_squared_error(y, model(x, training=True)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))

    for x, y in batches:
        step(tf.constant(x), tf.constant(y))
    return weights_of(model)


def joined(*indices):
    parts = [micro_batch(i % PER_EPOCH) for i in indices]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


# The updates each choice makes over EPOCHS epochs, as lists of micro-batch indices.
EXPECTED_UPDATES = {
    "carry": [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)],  # index i: micro-batch i % 5
    "flush": [(0, 1), (2, 3), (4,)] * EPOCHS,
    "discard": [(0, 1), (2, 3)] * EPOCHS,
}


def reference(action):
    return plain_steps([joined(*update) for update in EXPECTED_UPDATES[action]])


def model_under(strategy):
    with strategy.scope():
        model = tiny_model()
        model.compile(optimizer=AccumulatingOptimizer(OPTIMIZERS["adam"](), K), loss="mse")
    return model


def check_counters(optimizer, action):
    updates = len(EXPECTED_UPDATES[action])
    assert int(optimizer.iterations.numpy()) == updates
    assert int(optimizer.total_micro_steps.numpy()) == PER_EPOCH * EPOCHS
    assert int(optimizer.micro_steps.numpy()) == 0


@pytest.mark.parametrize("action", ["carry", "flush", "discard"])
def test_fit_with_the_callback_equals_plain_steps_on_the_batches_it_implies(strategy, action):
    model = model_under(strategy)
    history = model.fit(X, Y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[AccumulationCallback(action)])
    check_close(weights_of(model), reference(action))
    check_counters(model.optimizer, action)
    assert history.history["skipped_updates"] == [0] * EPOCHS


@pytest.mark.parametrize("action", ["carry", "flush", "discard"])
def test_a_custom_loop_calling_flush_or_discard_after_each_epoch_equals_the_same(strategy,
                                                                                 action):
    model = model_under(strategy)
    optimizer = model.optimizer
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    replica_step = make_replica_step(MICRO)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(MICRO)

    @tf.function
    def distributed_step(batch):
        strategy.run(replica_step, args=(model, optimizer, *batch))

    for _ in range(EPOCHS):
        for batch in strategy.experimental_distribute_dataset(dataset):
            distributed_step(batch)
        if action == "flush":
            optimizer.flush()
        elif action == "discard":
            optimizer.discard()
    check_close(weights_of(model), reference(action))
    check_counters(optimizer, action)


def test_without_the_callback_fit_carries_the_incomplete_cycle_on(strategy2):
    model = model_under(strategy2)
    model.fit(X, Y, batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    check_close(weights_of(model), reference("carry"))
    model.fit(X, Y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)  # 15 micro-batches
    assert int(model.optimizer.micro_steps.numpy()) == 1


def test_flush_inside_a_tf_function_at_the_top_level_and_with_nothing_pending(strategy2):
    model = model_under(strategy2)
    model.fit(X[:MICRO * 3], Y[:MICRO * 3], batch_size=MICRO, shuffle=False, verbose=0)
    tf.function(model.optimizer.flush)()  # micro-batch 3 alone
    check_close(weights_of(model), plain_steps([joined(0, 1), joined(2)]))
    model.optimizer.flush()  # nothing pending: no update
    assert int(model.optimizer.iterations.numpy()) == 2


def test_flush_inside_strategy_run_is_rejected(strategy2):
    model = model_under(strategy2)
    with strategy2.scope():
        model.optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match=r"flush\(\) must be called outside strategy.run"):
        tf.function(lambda: strategy2.run(model.optimizer.flush))()


@pytest.mark.usefixtures("collect_garbage")
def test_the_callback_finds_the_optimizer_inside_a_loss_scale_optimizer_and_needs_one():
    import keras

    wrapped = keras.mixed_precision.LossScaleOptimizer(AccumulatingOptimizer(
        OPTIMIZERS["sgd"](), K))
    from distgrad.callbacks import accumulating_optimizer_of

    assert accumulating_optimizer_of(wrapped) is wrapped.inner_optimizer
    model = tiny_model()
    model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    with pytest.raises(ValueError, match="needs an optimizer with flush"):
        model.fit(X, Y, batch_size=MICRO, verbose=0, callbacks=[AccumulationCallback("flush")])


def test_the_three_choices_train_different_weights():
    from distgrad_course.lab.compare import check_not_close

    check_not_close(reference("flush"), reference("carry"))
    check_not_close(reference("flush"), reference("discard"))
    check_not_close(reference("carry"), reference("discard"))
