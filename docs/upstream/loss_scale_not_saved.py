# model.save(".keras") under mixed_float16: is the dynamic loss scale saved?
import keras
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]  # 2 logical CPU devices: runs on any machine
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])
keras.mixed_precision.set_global_policy("mixed_float16")

def scale(optimizer):  # Keras 3: `dynamic_scale`; tf-keras: `loss_scale`
    value = getattr(optimizer, "dynamic_scale", None)
    return float(np.asarray(optimizer.loss_scale if value is None else value))

with strategy.scope():  # compile wraps SGD in a LossScaleOptimizer (initial scale 2**15)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1),
                              keras.layers.Activation("linear", dtype="float32")])
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
x = np.ones((4, 1), "float32")
model.fit(x, 1e4 * x, batch_size=4, verbose=0)  # overflows in float16: skipped, scale halved
saved = scale(model.optimizer)
model.save("mixed.keras")
with strategy.scope():
    loaded = scale(keras.models.load_model("mixed.keras").optimizer)  # tf-keras: 2**15 again
