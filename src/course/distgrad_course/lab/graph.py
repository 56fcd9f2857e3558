"""Read a traced step's graph: which collectives it runs, and under what control flow.

A step's communication is visible in its graph: every all-reduce that
`MirroredStrategy` or `MultiWorkerMirroredStrategy` emits is a collective op, one per
replica (each replica's graph holds its half of the ring; NCCL on GPUs is the same op
type with an NCCL hint). `tf.cond` branches and `tf.while_loop` bodies live in the
graph's function library, so one walker, `walk`, follows every function a node calls
and says whether a cond branch or a while body encloses it. Every count here is made
from it. Tracing only: nothing runs, no variable changes.
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow as tf

# `CollectiveReduceV2` is what CollectiveAllReduce (MirroredStrategy's default in TF 2,
# on CPUs and GPUs) and MultiWorkerMirroredStrategy emit; the others appear with other
# cross_device_ops.
ALL_REDUCE_OP_TYPES = frozenset(
    {"CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "NcclAllReduce"})
OTHER_COLLECTIVE_OP_TYPES = frozenset({
    "CollectiveGather", "CollectiveGatherV2", "CollectiveBcastSend", "CollectiveBcastRecv",
    "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveAllToAllV2",
    "CollectiveAllToAllV3", "NcclReduce", "NcclBroadcast"})
_COND_ATTRS = frozenset({"then_branch", "else_branch", "branches"})
_WHILE_ATTRS = frozenset({"body", "cond"})


@dataclasses.dataclass(frozen=True)
class Where:
    """What encloses a node: a `tf.cond` branch (runs only when taken) and/or a
    `tf.while_loop` (runs once per iteration)."""

    in_cond: bool = False
    in_while: bool = False


def walk(graph_def: tf.compat.v1.GraphDef):
    """Yield `(node, Where)` for every node reachable from the graph's top level.

    A function called from two places is walked twice (it runs twice); a function
    reached again through its own call chain is not (recursion guard).
    """
    library = {f.signature.name: list(f.node_def) for f in graph_def.library.function}
    todo = [(list(graph_def.node), Where(), frozenset())]
    while todo:
        nodes, where, visiting = todo.pop()
        for node in nodes:
            yield node, where
            called = [("", node.op)] if node.op in library else []
            for key, attr in node.attr.items():
                if attr.HasField("func"):
                    called.append((key, attr.func.name))
                elif attr.HasField("list"):
                    called.extend((key, f.name) for f in attr.list.func)
            for key, name in called:
                if name in library and name not in visiting:
                    inner = Where(where.in_cond or key in _COND_ATTRS,
                                  where.in_while or (node.op in ("While", "StatelessWhile")
                                                     and key in _WHILE_ATTRS))
                    todo.append((library[name], inner, visiting | {name}))


def graph_op_types(graph_def: tf.compat.v1.GraphDef) -> collections.Counter:
    """Op types of every reachable node, functions included."""
    return collections.Counter(node.op for node, _ in walk(graph_def))


def _per_replica(count: int, replicas: int, what: str) -> int:
    if count % replicas:
        raise ValueError(f"{count} {what} is not a multiple of {replicas} replicas; "
                         "the graph is not a symmetric replicated step.")
    return count // replicas


def _graph_of(function, *args, **kwargs) -> tf.compat.v1.GraphDef:
    if not hasattr(function, "get_concrete_function"):
        raise TypeError("needs a tf.function (decorate the step with @tf.function); "
                        f"got {type(function).__name__}.")
    return function.get_concrete_function(*args, **kwargs).graph.as_graph_def()


def _replicas(replicas: int | None) -> int:
    return tf.distribute.get_strategy().num_replicas_in_sync if replicas is None else replicas


@dataclasses.dataclass(frozen=True)
class CollectiveCount:
    """Cross-device op counts of one traced function.

    `all_reduce_ops` counts every all-reduce op (one per replica per reduction);
    `all_reduces` divides by the replica count: how many times the replicas
    synchronize, the number lessons talk about.
    """

    op_types: dict
    replicas: int

    @property
    def all_reduce_ops(self) -> int:
        return sum(n for t, n in self.op_types.items() if t in ALL_REDUCE_OP_TYPES)

    @property
    def all_reduces(self) -> int:
        return _per_replica(self.all_reduce_ops, self.replicas, "all-reduce ops")

    @property
    def collective_ops(self) -> int:
        return sum(self.op_types.values())


def count_collectives(function, *args, replicas: int | None = None, **kwargs) -> CollectiveCount:
    """Trace `function` (a `tf.function`) for `args` and count its collective ops.

    `replicas` defaults to the replica count of the strategy in scope. Raises TypeError
    if `function` is not a `tf.function`.
    """
    counts = graph_op_types(_graph_of(function, *args, **kwargs))
    wanted = ALL_REDUCE_OP_TYPES | OTHER_COLLECTIVE_OP_TYPES
    return CollectiveCount({t: n for t, n in counts.items() if t in wanted}, _replicas(replicas))


@dataclasses.dataclass(frozen=True)
class AllReducePlacement:
    """All-reduces of one traced step (per replica), by the control flow around them.

    `every_call`: run each time the step runs; `conditional`: inside a cond branch,
    run only when it is taken; `in_while_bodies`: inside a `tf.while_loop` (run once
    per iteration); `while_loops`: While ops per replica.
    """

    every_call: int
    conditional: int
    in_while_bodies: int = 0
    while_loops: int = 0

    @property
    def all_reduces(self) -> int:
        return self.every_call + self.conditional

    def per_update(self, steps: int) -> int:
        """All-reduces per optimizer update when the step runs `steps` times per update
        and the conditional ones run once per update."""
        return self.every_call * steps + self.conditional


def placement_of_graph(graph_def: tf.compat.v1.GraphDef, replicas: int) -> AllReducePlacement:
    """`AllReducePlacement` of a GraphDef (pure function)."""
    counts = collections.Counter()
    for node, where in walk(graph_def):
        if node.op in ALL_REDUCE_OP_TYPES:
            counts["conditional" if where.in_cond else "every_call"] += 1
            counts["in_while_bodies"] += where.in_while
        counts["while_loops"] += node.op in ("While", "StatelessWhile")
    return AllReducePlacement(**{
        key: _per_replica(counts[key], replicas, key.replace("_", " "))
        for key in ("every_call", "conditional", "in_while_bodies", "while_loops")})


def all_reduce_placement(function, *args, replicas: int | None = None) -> AllReducePlacement:
    """Trace `function` (a `tf.function`) for `args`; place its all-reduces."""
    return placement_of_graph(_graph_of(function, *args), _replicas(replicas))


def _python_graphs(graph):
    """`graph` and every function graph its ops call (cond branches, loop bodies, calls)."""
    todo, seen = [graph], set()
    while todo:
        current = todo.pop()
        yield current
        for op in current.get_operations():
            for attr in op.node_def.attr.values():
                names = [attr.func.name] if attr.HasField("func") else (
                    [f.name for f in attr.list.func] if attr.HasField("list") else [])
                for name in names:
                    called = getattr(current._get_function(name), "graph", None)
                    if called is not None and name not in seen:
                        seen.add(name)
                        todo.append(called)


def all_reduce_sizes(function, *args, replicas: int | None = None) -> list[int]:
    """Elements each all-reduce of one replica moves, largest first, for `function(*args)`.

    Read from the traced graphs' static shapes (-1 when unknown), cond branches and loop
    bodies included: a packed gradient all-reduce moves every gradient element at once,
    a finiteness flag or a reported loss moves 1. Raises TypeError for a non-tf.function.
    """
    if not hasattr(function, "get_concrete_function"):
        raise TypeError(f"needs a tf.function, got {type(function).__name__}.")
    return graph_all_reduce_sizes(function.get_concrete_function(*args).graph,
                                  _replicas(replicas))


def graph_all_reduce_sizes(graph, replicas: int) -> list[int]:
    """`all_reduce_sizes` of a traced (Python) graph, e.g. a concrete function's."""
    sizes = sorted((-1 if op.inputs[0].shape.num_elements() is None
                    else op.inputs[0].shape.num_elements())
                   for g in _python_graphs(graph) for op in g.get_operations()
                   if op.type in ALL_REDUCE_OP_TYPES)
    _per_replica(len(sizes), replicas, "all-reduce ops")
    per_replica = sizes[::replicas]  # each replica runs the same all-reduces
    return sorted(per_replica, reverse=True)


def fit_step_placement(model, x, y, batch_size: int) -> AllReducePlacement:
    """All-reduce placement of the step `model.fit(x, y, batch_size=batch_size)` runs.

    Traces `model.train_function` as `fit` builds it (`make_train_function`), including
    Keras' `strategy.run` and its reduction of the logs, on a distributed iterator over
    `(x, y)`. The model must be compiled and built (e.g. after one `fit` call).

    Raises:
        ValueError: the model was compiled with `steps_per_execution` != 1.
        RuntimeError: the installed Keras no longer wraps one `tf.function` there.
    """
    graph = _fit_step_graph(model, x, y, batch_size)
    return placement_of_graph(graph.as_graph_def(), model.distribute_strategy.num_replicas_in_sync)


def fit_step_all_reduce_sizes(model, x, y, batch_size: int) -> list[int]:
    """`all_reduce_sizes` of the step `model.fit` runs (as `fit_step_placement` traces it)."""
    graph = _fit_step_graph(model, x, y, batch_size)
    return graph_all_reduce_sizes(graph, model.distribute_strategy.num_replicas_in_sync)


def _fit_step_graph(model, x, y, batch_size: int):
    strategy = model.distribute_strategy
    if model.steps_per_execution != 1:
        raise ValueError("fit_step_placement traces one step: compile with "
                         "steps_per_execution=1.")
    model.make_train_function(force=True)
    # The tf.function fit calls on the iterator, by its name in Keras' trainer.py (Keras
    # 3.10-3.11 also close over the per-batch tf.function `one_step_on_data`, 3.12+ over a
    # plain wrapper of it).
    function = model.train_function
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    named = dict(zip(code.co_freevars, cells or ())) if code else {}
    traced = getattr(named.get("multi_step_on_iterator"), "cell_contents", None)
    if not hasattr(traced, "get_concrete_function"):
        raise RuntimeError(
            "model.train_function no longer wraps the tf.function `multi_step_on_iterator` "
            "(keras/src/backend/tensorflow/trainer.py changed): update fit_step_placement.")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    return traced.get_concrete_function(iterator).graph
