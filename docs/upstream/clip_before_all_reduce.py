# SGD(global_clipnorm=1) in model.fit: one device vs MirroredStrategy with 2 replicas.
import keras
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]  # 2 logical CPU devices: runs on any machine
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])

x, y = np.ones((2, 1), "float32"), np.array([[3.0], [-1.0]], "float32")  # one example a replica

def trained(scope):  # w starts at 0; the full-batch gradient is -2, clipped to -1: w = 1
    with scope:
        dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
        model = keras.Sequential([keras.Input((1,)), dense])
        model.compile(keras.optimizers.SGD(1.0, global_clipnorm=1.0), loss="mse")
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    return float(np.asarray(model.weights[0])[0, 0])

one_device, two_replicas = trained(tf.distribute.get_strategy().scope()), trained(strategy.scope())
print(f"w after one step: one device {one_device}, 2 replicas {two_replicas}")  # 1.0 vs 0.0
