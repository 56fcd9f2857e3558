# Adam, one step, the same all-reduced embedding gradient: dense vs tf.IndexedSlices.
import keras
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]  # 2 logical CPU devices: runs on any machine
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])

def one_adam_step(dense):
    with strategy.scope():
        table = keras.layers.Embedding(1, 1, embeddings_initializer="zeros")
        table.build((1,))
        adam = keras.optimizers.Adam(0.1)
        adam.build([table.embeddings])
    def replica_fn():  # each replica looks row 0 up once: unique indices on each replica
        with tf.GradientTape() as tape:
            loss = -tf.reduce_sum(table(tf.constant([0])))
        grad = tape.gradient(loss, table.embeddings)  # tf.IndexedSlices, indices [0]
        adam.apply_gradients([(tf.convert_to_tensor(grad) if dense else grad, table.embeddings)])
    tf.function(lambda: strategy.run(replica_fn))()
    return float(table.embeddings.numpy()[0, 0])
dense, sparse = one_adam_step(dense=True), one_adam_step(dense=False)
print(f"row 0 after one step: dense {dense:.6f}, IndexedSlices {sparse:.6f}")  # 0.1 vs 0.1414
