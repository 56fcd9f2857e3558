# model.fit with SGD(gradient_accumulation_steps=2) under MirroredStrategy (2 replicas).
import keras
import numpy as np
import tensorflow as tf

kind = "GPU" if len(tf.config.list_physical_devices("GPU")) >= 2 else "CPU"
if kind == "CPU":  # fewer than 2 GPUs: split the CPU into 2 logical devices
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy([f"/{kind}:0", f"/{kind}:1"])

with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
x = np.ones((8, 1), "float32")
model.fit(x, x, batch_size=4, epochs=1, verbose=0)
# RuntimeError: ... `merge_call` called while defining a new graph or a tf.function. ...
