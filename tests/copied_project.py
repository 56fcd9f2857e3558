"""A user's project that copied three reference classes' files, each alone.

Run as `python copied_project.py DIR` where DIR holds copies of `optimizer.py`,
`accumulator.py` and `train_step.py`. Importing `distgrad` raises here, so
the copies must work alone. Trains each under a 2-replica MirroredStrategy and prints, as JSON,
how far each is from one-device big-batch training (`allclose_ratio`).
"""

import json
import os
import sys


class _NoDistgrad:
    def find_spec(self, name, path=None, target=None):
        if name == "distgrad" or name.startswith("distgrad."):
            raise ImportError("distgrad is not installed in this project")


sys.meta_path.insert(0, _NoDistgrad())
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

from accumulator import GradientAccumulator  # noqa: E402
from optimizer import AccumulatingOptimizer  # noqa: E402
from train_step import MicroBatchingModel  # noqa: E402

K, MICRO, EXAMPLES = 4, 4, 32
rng = np.random.default_rng(0)
x = rng.normal(size=(EXAMPLES, 4)).astype("float32")
y = (x @ rng.normal(size=(4, 1)) + 0.1 * rng.normal(size=(EXAMPLES, 1))).astype("float32")


def layers():
    init = keras.initializers.GlorotUniform
    return [keras.Input((4,)), keras.layers.Dense(8, "tanh", kernel_initializer=init(seed=0)),
            keras.layers.Dense(1, kernel_initializer=init(seed=1))]


def big_batch():
    model = keras.Sequential(layers())
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=K * MICRO, shuffle=False, verbose=0)
    return model.get_weights()


def allclose_ratio(weights, reference, rtol=1e-6, atol=1e-6):
    """max |a - b| / (atol + rtol |b|): <= 1 exactly when np.allclose(a, b, rtol, atol)."""
    return max(float(np.max(np.abs(a - b) / (atol + rtol * np.abs(b))))
               for a, b in zip(weights, reference))


def accumulating_optimizer():
    with strategy.scope():
        model = keras.Sequential(layers())
        model.compile(AccumulatingOptimizer(keras.optimizers.Adam(0.01), K), "mse")
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    return model.get_weights()


def micro_batching():
    with strategy.scope():
        plain = keras.Sequential(layers())
        model = MicroBatchingModel(plain.inputs, plain.outputs, accumulation_steps=K // 2)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=K * MICRO, shuffle=False, verbose=0)
    return model.get_weights()


def gradient_accumulator():
    with strategy.scope():
        model = keras.Sequential(layers())
        optimizer = keras.optimizers.Adam(0.01)
        accumulator = GradientAccumulator(model.trainable_variables)
    apply_step = accumulator.make_apply_step(optimizer)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)

    def replica_accumulate(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=K * MICRO)
        accumulator.add(tape.gradient(loss, model.trainable_variables))

    accumulate = tf.function(lambda batch: strategy.run(replica_accumulate, args=batch))
    for step, batch in enumerate(strategy.experimental_distribute_dataset(dataset), 1):
        accumulate(batch)
        if step % K == 0:
            apply_step()
    return model.get_weights()


reference = big_batch()
print(json.dumps({name: allclose_ratio(train(), reference) for name, train in (
    ("AccumulatingOptimizer", accumulating_optimizer),
    ("GradientAccumulator", gradient_accumulator),
    ("MicroBatching", micro_batching))}))
