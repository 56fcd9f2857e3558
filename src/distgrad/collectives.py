"""Count the cross-device reductions a traced `tf.function` performs.

A step's communication cost is visible in its graph: every all-reduce that
`MirroredStrategy` or `MultiWorkerMirroredStrategy` emits is a collective op, one
per replica (each replica's graph holds its half of the ring). With NCCL on GPUs it
is the same op type with an NCCL hint. We count op types, including those inside
nested function bodies (`tf.cond` / `tf.while_loop` branches live in the graph's
function library, not in its top-level ops).
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow as tf

# Op types that move data between replicas. `CollectiveReduceV2` is what
# CollectiveAllReduce (MirroredStrategy's default in TF 2, on CPUs and GPUs) and
# MultiWorkerMirroredStrategy emit; the others appear with other cross_device_ops.
ALL_REDUCE_OP_TYPES = frozenset(
    {"CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "NcclAllReduce"}
)
OTHER_COLLECTIVE_OP_TYPES = frozenset(
    {
        "CollectiveGather",
        "CollectiveGatherV2",
        "CollectiveBcastSend",
        "CollectiveBcastRecv",
        "CollectiveBcastSendV2",
        "CollectiveBcastRecvV2",
        "CollectiveAllToAllV2",
        "CollectiveAllToAllV3",
        "NcclReduce",
        "NcclBroadcast",
    }
)


@dataclasses.dataclass(frozen=True)
class CollectiveCount:
    """Cross-device op counts of one traced function.

    `all_reduce_ops` counts every all-reduce op in the graph (one per replica per
    reduction); `all_reduces` divides by the replica count: how many times the
    replicas synchronize, which is the number lessons talk about.
    """

    op_types: dict
    replicas: int

    @property
    def all_reduce_ops(self) -> int:
        return sum(n for t, n in self.op_types.items() if t in ALL_REDUCE_OP_TYPES)

    @property
    def all_reduces(self) -> int:
        ops = self.all_reduce_ops
        if ops % self.replicas:
            raise ValueError(
                f"{ops} all-reduce ops is not a multiple of {self.replicas} replicas; "
                "the graph is not a symmetric replicated step."
            )
        return ops // self.replicas

    @property
    def collective_ops(self) -> int:
        return sum(self.op_types.values())


def graph_op_types(graph_def: tf.compat.v1.GraphDef) -> collections.Counter:
    """Op types in a GraphDef, including every function in its library."""
    counts = collections.Counter(node.op for node in graph_def.node)
    for function in graph_def.library.function:
        counts.update(node.op for node in function.node_def)
    return counts


def count_collectives(
    function, *args, replicas: int | None = None, **kwargs
) -> CollectiveCount:
    """Trace `function` (a `tf.function`) for `args` and count its collective ops.

    `replicas` defaults to the replica count of the strategy in scope when called
    (pass it explicitly when tracing outside the scope). The function is traced, not
    run: no variable changes.

    Raises TypeError if `function` is not a `tf.function`.
    """
    if not hasattr(function, "get_concrete_function"):
        raise TypeError(
            "count_collectives needs a tf.function (decorate the step with @tf.function); "
            f"got {type(function).__name__}."
        )
    concrete = function.get_concrete_function(*args, **kwargs)
    if replicas is None:
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
    counts = graph_op_types(concrete.graph.as_graph_def())
    wanted = ALL_REDUCE_OP_TYPES | OTHER_COLLECTIVE_OP_TYPES
    return CollectiveCount({t: n for t, n in counts.items() if t in wanted}, replicas)
