"""The hand-arithmetic specs' shared helpers (a helper module, no tests): the counters of an
AccumulatingOptimizer, one SGD variable and wrapper, and one `optimizer.apply` on two
replicas. Used by accumulating_optimizer/test_optimizer_hand_arithmetic.py and
accumulation_callback/test_epoch_ends_hand_arithmetic.py.
"""

import keras
import tensorflow as tf

from distgrad.optimizer import AccumulatingOptimizer


def _counters(optimizer):
    return (int(optimizer.iterations.numpy()), int(optimizer.total_micro_steps.numpy()),
            int(optimizer.micro_steps.numpy()))


def _replica_shares_call(strategy, optimizer, variable):
    """`call(g)`: one `optimizer.apply` in which replica r passes gradient (r + 1) * g."""
    @tf.function
    def call(g):
        def replica_fn():
            r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            optimizer.apply([(r + 1.0) * g], [variable])
        strategy.run(replica_fn)

    return call


def _sgd_wrapper(k, **kwargs):
    variable = keras.Variable([1.0, 2.0])
    optimizer = AccumulatingOptimizer(keras.optimizers.SGD(0.5), accumulation_steps=k, **kwargs)
    optimizer.build([variable])
    return variable, optimizer
