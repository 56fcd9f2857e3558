# TensorFlow only: a tf.cond branch that calls a tf.function containing an all-reduce.
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]  # 2 logical CPU devices: runs on any machine
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])

def all_reduce_once():  # cross-replica: one SUM all-reduce of 1.0 on every replica
    per_replica = strategy.run(
        lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0)))
    return strategy.reduce("MEAN", per_replica, axis=None)

inline = tf.function(lambda: tf.cond(tf.constant(True), all_reduce_once, lambda: 0.0))
inline_result = float(inline())  # 2.0: the SUM over 2 replicas, written in the branch
nested = tf.function(all_reduce_once)
nested_result = float(tf.function(lambda: nested())())  # 2.0: called from a tf.function
in_loop_result = float(tf.function(lambda: tf.while_loop(  # 2.0: called from a loop body
    lambda i, s: i < 1, lambda i, s: (i + 1, s + nested()), (0, 0.0))[1])())
print("inline, from a tf.function, from a loop:", inline_result, nested_result, in_loop_result)
in_branch = tf.function(lambda: tf.cond(tf.constant(True), nested, lambda: 0.0))
in_branch()  # InvalidArgumentError: You must feed a value for placeholder tensor '.../Placeholder'
