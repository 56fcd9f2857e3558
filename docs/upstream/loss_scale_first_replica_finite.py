# LossScaleOptimizer under MirroredStrategy: an overflow on replica 1 only is not skipped.
import keras
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]  # 2 logical CPU devices: runs on any machine
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])

with strategy.scope():
    v = keras.Variable([1.0])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    optimizer.build([v])
@tf.function
def step(bad):  # replica `bad` gets an inf gradient, the other replica a finite one
    def replica_fn():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        optimizer.apply_gradients([(tf.where(replica == bad, float("inf"), 1.0) * tf.ones([1]), v)])
    strategy.run(replica_fn)
step(0)
inf_on_replica_0 = float(v.numpy()[0])  # 1.0: the step was skipped
step(1)
inf_on_replica_1 = float(v.numpy()[0])  # -inf: the step was applied
print(f"v after an inf on replica 0: {inf_on_replica_0}, then on replica 1: {inf_on_replica_1}")
