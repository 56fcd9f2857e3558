# model.fit with steps_per_execution=2 under MirroredStrategy (2 replicas), plain SGD.
import keras
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]  # 2 logical CPU devices: runs on any machine
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])

with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
x = np.ones((8, 1), "float32")
model.fit(x, x, batch_size=2, epochs=1, verbose=0)
# InvalidArgumentError: You must feed a value for placeholder tensor 'while/body/.../Placeholder'
