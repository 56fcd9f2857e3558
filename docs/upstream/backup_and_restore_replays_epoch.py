# BackupAndRestore(save_freq=3), MirroredStrategy: a fit stopped after 6 of 16 batches, resumed.
import keras
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]  # 2 logical CPU devices: runs on any machine
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])
x = np.repeat(np.arange(1, 9, dtype="float32"), 2)[:, None]  # 8 batches of 2: batch k holds k+1
backup = keras.callbacks.BackupAndRestore("replay_backup", save_freq=3)  # removed when fit ends

def fit(callbacks):  # a fresh model; w*x stays below y, so each SGD step adds its batch's x to w
    with strategy.scope():
        dense = keras.layers.Dense(1, kernel_initializer="zeros")
        model = keras.Sequential([keras.Input((1,)), dense])
        model.compile(keras.optimizers.SGD(1.0), loss="mae")
    try:
        model.fit(x, x + 1e3, batch_size=2, epochs=2, shuffle=False, callbacks=callbacks, verbose=0)
    except ZeroDivisionError:  # the crash below, after the backup of batches 0-5 (6 updates, w 21)
        pass
    return int(np.asarray(model.optimizer.iterations)), float(np.asarray(dense.kernel)[0, 0])

uninterrupted_updates, uninterrupted_w = fit([])  # 16 updates, w = 2 * (1 + ... + 8) = 72
fit([backup, keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: b == 5 and 1 / 0)])
resumed_updates, resumed_w = fit([backup])  # Keras 3: 22, 93 (batches 0-5 again); tf-keras: 16, 60
