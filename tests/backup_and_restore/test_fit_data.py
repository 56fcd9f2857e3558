"""`distgrad.fit_data`: what `BackupAndRestore` learns of `fit`'s data from `fit`'s own
arguments (`ResumableFit`), with no look at Keras' internals."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from distgrad.backup_and_restore import ResumableFit, ResumableFitModel, describe_fit_data


def test_arrays_give_their_batch_count_and_keras_default_batch():
    x, y = np.zeros((100, 3), "float32"), np.zeros((100,), "float32")
    data = describe_fit_data(x, y, shuffle=False, validation_split=0.2)
    assert (data.why_order, data.global_batch, data.batches) == ("", 32, 3)  # 80 / 32
    shuffled = describe_fit_data({"a": x}, y, batch_size=10)
    assert shuffled.why_order == "fit(shuffle=True) shuffles the arrays anew in every epoch"
    assert shuffled.order_certain and shuffled.batches == 10


def test_a_dataset_gives_its_batch_its_cardinality_and_its_shuffles():
    base = tf.data.Dataset.range(64).map(lambda i: (tf.cast(i, tf.float32), i))
    data = describe_fit_data(base.batch(8, drop_remainder=True))
    assert (data.why_order, data.global_batch, data.batches) == ("", 8, 8)
    assert describe_fit_data(base.batch(8)).global_batch is None  # a smaller last batch
    assert describe_fit_data(base.batch(8).repeat()).batches is None
    reshuffled = describe_fit_data(base.shuffle(64, seed=1).batch(8))
    assert "reshuffle_each_iteration=True" in reshuffled.why_order and reshuffled.order_certain


def test_what_cannot_be_inspected_is_said_and_not_certain():
    data = describe_fit_data(iter([]))
    assert "cannot be inspected" in data.why_order and not data.order_certain
    assert data.global_batch is None


@pytest.mark.parametrize("steps_per_epoch, batches, read, new", [
    (None, 8, 3, True),  # Keras: a new iterator every epoch
    (8, None, 8, False),  # an infinite dataset: one iterator for all epochs
    (8, 16, 8, False),  # 16 batches read over two epochs
    (8, 16, 16, True),
])
def test_a_new_iterator_where_keras_makes_one(steps_per_epoch, batches, read, new):
    data = describe_fit_data(
        tf.data.Dataset.range(batches or 1).batch(1).repeat(None if batches is None else 1),
        steps_per_epoch=steps_per_epoch)
    assert data.batches == batches and data.new_iterator_after(read) is new


def test_resumable_fit_hands_fit_arguments_to_the_callbacks_that_take_them():
    seen = []

    class Taker(keras.callbacks.Callback):
        def set_fit_arguments(self, **arguments):
            seen.append(arguments)

    inputs = keras.Input((2,))
    model = ResumableFitModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 2), "float32"), np.ones((8,), "float32")
    model.fit(x, y, 4, 1, 0, [Taker(), keras.callbacks.History()], shuffle=False)
    assert seen == [{"x": x, "y": y, "batch_size": 4, "shuffle": False,
                     "steps_per_epoch": None, "validation_split": 0.0}]
    model.fit(x, y, verbose=0, callbacks=keras.callbacks.CallbackList([Taker()], model=model))
    assert seen[1]["shuffle"] is True and seen[1]["batch_size"] is None  # Keras' defaults
    assert issubclass(ResumableFitModel, ResumableFit)
    assert keras.saving.get_registered_object("distgrad>ResumableFitModel") is ResumableFitModel
