"""distgrad for tf-keras (Keras 2): `AccumulatingOptimizer` for `model.fit`.

`distgrad.tf_keras.AccumulatingOptimizer` (in `distgrad/tf_keras/optimizer.py`) is the
tf-keras class; `distgrad.AccumulatingOptimizer` is the Keras 3 one. They are two
classes because tf-keras and Keras 3 optimizers differ in kind (base class, the
`apply_gradients` / `apply` protocol, where the all-reduce and the clipping happen), and a
process has one of the two behind `tf.keras`. Import it where `TF_USE_LEGACY_KERAS=1` was
set before TensorFlow was imported, or on TensorFlow 2.15, whose own `tf.keras` is Keras 2;
in a Keras 3 process the import fails with an `ImportError` that says so.
`GradientAccumulator` (`distgrad/accumulator.py`) takes either kind of optimizer.
"""

from distgrad.tf_keras.optimizer import AccumulatingOptimizer

__all__ = ["AccumulatingOptimizer"]
