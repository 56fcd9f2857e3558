# model.fit on MultiWorkerMirroredStrategy: 2 worker processes on this machine, one CPU
# replica each (tensorflow.org's "Multi-worker training with Keras", cut down). Run it twice:
#   export CUDA_VISIBLE_DEVICES=""
#   TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
#     "task": {"type": "worker", "index": 0}}' python multi_worker_fit.py &
#   TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
#     "task": {"type": "worker", "index": 1}}' python multi_worker_fit.py
import keras
import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
x = np.ones((16, 1), "float32")
dataset = tf.data.Dataset.from_tensor_slices((x, x)).batch(8)  # global batch: 4 per worker
with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), loss="mse")
model.fit(dataset, epochs=1, verbose=0)
# ValueError: Attempt to convert a value (PerReplica:{ 0: <tf.Tensor: shape=(4, 1), ...> })
#   with an unsupported type (<class '...values.PerReplica'>) to a Tensor.
