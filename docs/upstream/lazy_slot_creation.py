# A custom loop under MirroredStrategy whose first call builds the optimizer's slots.
import keras
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]  # 2 logical CPU devices: runs on any machine
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])

with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)  # not built: slots are made lazily

@tf.function
def train_step(x):
    def replica_fn(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    strategy.run(replica_fn, args=(x,))

train_step(tf.ones((2, 1)))
# InvalidArgumentError: You must feed a value for placeholder tensor 'cond/else/_1/cond/...'
