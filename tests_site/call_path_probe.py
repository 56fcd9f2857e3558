"""Child target of test_docs_claims: what one traced SGD step under MirroredStrategy calls.

Run in a fresh process (`distgrad_course.lab.child`): it needs 2 logical CPU devices, which must
exist before TensorFlow initializes.
"""

from __future__ import annotations

import collections

DISTRIBUTE_LIB = "tensorflow.python.distribute.distribute_lib"


def merge_calls_of_one_sgd_step() -> dict:
    """Trace one SGD step on 2 replicas; the `merge_call` functions by qualified name
    (counted) and, per `batch_reduce_to` call, whether it ran in cross-replica context."""
    from distgrad_course.devices import make_strategy

    strategy = make_strategy(2)
    import tensorflow as tf

    from distgrad_course.lab.recipes import untraced_sgd_step
    from distgrad_course.lab.spy import spying

    distributed_step, batch = untraced_sgd_step(strategy)
    merge_fns, reduce_contexts = [], []

    def before(spec, owner, args):
        if spec[2] == "merge_call":
            merge_fns.append(getattr(args[0], "__qualname__", repr(args[0])))
        else:
            reduce_contexts.append(tf.distribute.in_cross_replica_context())
        return args

    with spying([(DISTRIBUTE_LIB, "ReplicaContext", "merge_call"),
                 (DISTRIBUTE_LIB, "StrategyExtendedV2", "batch_reduce_to")], before):
        distributed_step.get_concrete_function(batch)
    return {"merge_fns": collections.Counter(merge_fns), "reduce_contexts": reduce_contexts}
