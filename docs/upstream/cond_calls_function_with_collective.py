# TensorFlow only: a tf.cond branch that calls a tf.function containing an all-reduce.
import tensorflow as tf
kind = "GPU" if len(tf.config.list_physical_devices("GPU")) >= 2 else "CPU"
if kind == "CPU":  # fewer than 2 GPUs: split the CPU into 2 logical devices
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy([f"/{kind}:0", f"/{kind}:1"])

def all_reduce_once():  # cross-replica: one SUM all-reduce of 1.0 on every replica
    per_replica = strategy.run(
        lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0)))
    return strategy.reduce("MEAN", per_replica, axis=None)

inline = tf.function(lambda: tf.cond(tf.constant(True), all_reduce_once, lambda: 0.0))
inline_result = float(inline())  # 2.0: the SUM over 2 replicas
print("all-reduce inline in the branch:", inline_result)
nested = tf.function(all_reduce_once)
in_branch = tf.function(lambda: tf.cond(tf.constant(True), nested, lambda: 0.0))
in_branch()  # InvalidArgumentError: You must feed a value for placeholder tensor '.../Placeholder'
