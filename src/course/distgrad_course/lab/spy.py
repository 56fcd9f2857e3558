"""Spy on methods: which ones run, in which distribution context, on which gradients.

One mechanism, `spying(methods, before, after)`, patches methods on their classes for
the length of a block. Two recorders use it:

* `record_sync_path(fn)` (lesson 01): the functions on the path from
  `optimizer.apply_gradients` to the variable update, one `SyncEvent` per Python call
  with the context it ran in. A `tf.function` runs its Python only while tracing, so
  call `fn` on a fresh `tf.function` (or eagerly) to see the path.
* `GradientSpy` (lesson 04): every *execution* of a traced method, with the gradients it
  received as a multiple of a reference gradient (`SpyRecord`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import threading

import numpy as np
import tensorflow as tf


def current_context() -> str:
    """ "replica", "cross-replica" or "default" for the code running now."""
    if tf.distribute.in_cross_replica_context():
        return "cross-replica"
    if not tf.distribute.has_strategy():
        return "default"
    return "replica"


def _defining_class(module_name: str, class_name: str, method_name: str):
    named = getattr(importlib.import_module(module_name), class_name)
    for cls in named.__mro__:
        if method_name in cls.__dict__:
            return cls
    raise AttributeError(f"{module_name}.{class_name} has no method {method_name!r}.")


@contextlib.contextmanager
def spying(methods, before=None, after=None):
    """Patch every `(module, class, method)` triple in `methods` for the block.

    Each call of a patched method runs `args = before(spec, owner, args)` if given
    (`spec` is the triple, `owner` the instance, `args` the positional arguments after
    `self`; `before` returns the arguments to pass on, so it may replace a one-shot
    iterator it consumed by a list), then the original, then `after(spec, owner,
    result)` if given; the result is returned unchanged. The class that *defines* the method is
    patched (a base class where inherited), once even if several triples lead to it.
    Every original is restored on exit, also on error. Raises AttributeError for a
    method no class in the named class' MRO defines.
    """
    originals = []
    try:
        for spec in methods:
            cls = _defining_class(*spec)
            method_name = spec[2]
            if any(c is cls and m == method_name for c, m, _ in originals):
                continue  # already spied on through another name
            original = cls.__dict__[method_name]

            def spy(owner, *args, _spec=spec, _original=original, **kwargs):
                if before is not None:
                    args = before(_spec, owner, args)
                result = _original(owner, *args, **kwargs)
                if after is not None:
                    after(_spec, owner, result)
                return result

            originals.append((cls, method_name, original))
            setattr(cls, method_name, spy)
        yield
    finally:
        for cls, method_name, original in reversed(originals):
            setattr(cls, method_name, original)


# --- the sync path of apply_gradients (lesson 01) -------------------------------------

# The places where a gradient's journey changes context, in path order, as
# `module.Class.method`; SYNC_PATH_FUNCTIONS holds them as `spying`'s triples.
SYNC_PATH = (
    "keras.src.optimizers.base_optimizer.BaseOptimizer.apply_gradients",
    "keras.src.optimizers.base_optimizer.BaseOptimizer.apply",
    "keras.src.optimizers.base_optimizer.BaseOptimizer._clip_gradients",
    "keras.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step",
    "keras.src.backend.tensorflow.optimizer.TFOptimizer._all_reduce_sum_gradients",
    "tensorflow.python.distribute.distribute_lib.ReplicaContext.all_reduce",
    "tensorflow.python.distribute.distribute_lib.ReplicaContext.merge_call",
    "tensorflow.python.distribute.distribute_lib.StrategyExtendedV2.batch_reduce_to",
    "keras.src.backend.tensorflow.optimizer.TFOptimizer._distributed_tf_update_step",
    "tensorflow.python.distribute.distribute_lib.StrategyExtendedV2.update",
    "keras.src.optimizers.sgd.SGD.update_step",
    "keras.src.optimizers.adam.Adam.update_step",
)
SYNC_PATH_FUNCTIONS = tuple(tuple(name.rsplit(".", 2)) for name in SYNC_PATH)


@dataclasses.dataclass(frozen=True)
class SyncEvent:
    """One call: `Class.method`, the context it ran in, and the thread that ran it.

    `context` is "replica" (inside `strategy.run`, per replica), "cross-replica"
    (inside `merge_call` or at the top level with a strategy scope) or "default"
    (no strategy).
    """

    function: str
    context: str
    thread: str


def record_sync_path(fn, *args, functions=SYNC_PATH_FUNCTIONS, **kwargs):
    """Run `fn(*args, **kwargs)` with the sync-path `functions` spied on.

    Returns `(result, events)`; `events` lists every spied call in order, named by
    the class the triple names (`BaseOptimizer.apply_gradients`, not `SGD....`).
    """
    events: list[SyncEvent] = []
    lock = threading.Lock()

    def before(spec, owner, call_args):
        with lock:
            events.append(SyncEvent(f"{spec[1]}.{spec[2]}", current_context(),
                                    threading.current_thread().name))
        return call_args

    with spying(functions, before):
        result = fn(*args, **kwargs)
    return result, events


def summarize_path(events) -> list[tuple[str, str, int]]:
    """`(function, context, calls)` in first-call order; one replica's calls per step
    count once per replica thread, so `calls` is usually the replica count."""
    counts = collections.Counter((e.function, e.context) for e in events)
    seen, rows = set(), []
    for e in events:
        key = (e.function, e.context)
        if key not in seen:
            seen.add(key)
            rows.append((e.function, e.context, counts[key]))
    return rows


# --- gradients per executed call (lesson 04) -------------------------------------------

# Where a spied method's gradients are: "pairs" (first argument: (gradient, variable)
# pairs, maybe a one-shot zip), "list" (a list of gradients), "single" (one gradient,
# no ratio), "none" (no gradients), "pairs+result" (pairs, and the pairs it returns).
GRADIENT_KINDS = ("pairs", "list", "single", "none", "pairs+result")


@dataclasses.dataclass(frozen=True)
class SpiedCall:
    """One execution of a spied method.

    `function` is `<class of self>.<method>` (so a wrapper's and its inner optimizer's
    `apply_gradients` are told apart), `context` "replica" or "cross-replica",
    `replica` the replica id in replica context (else None), `dtypes` the gradient
    dtypes, `scale_seen` the least-squares ratio of the gradients passed to the
    reference gradient ("nan" if they are not finite; None where not measured).
    """

    step: int
    function: str
    context: str
    replica: int | None
    dtypes: tuple[str, ...]
    scale_seen: float | None


@dataclasses.dataclass(frozen=True)
class SpyRecord:
    """Every executed spied call, and how to query it.

    `traced` lists the spied functions in the order the step's Python called them
    while being traced (execution order of independent ops is not defined).
    """

    calls: tuple[SpiedCall, ...]
    traced: tuple[str, ...]

    def of(self, function: str, step: int | None = None) -> list[SpiedCall]:
        return [c for c in self.calls
                if c.function == function and (step is None or c.step == step)]

    def count(self, function: str, step: int | None = None) -> int:
        return len(self.of(function, step))

    def table(self) -> list[tuple]:
        """`(step, function, context, calls, dtypes, scale_seen)` rows, one per
        (step, function, context) in trace order, `scale_seen` of the first call."""
        rows = {}
        for c in self.calls:
            key = (c.step, c.function, c.context)
            if key not in rows:
                rows[key] = [c.step, c.function, c.context, 0, c.dtypes, c.scale_seen]
            rows[key][3] += 1
        order = {f: i for i, f in enumerate(self.traced)}
        return [tuple(r) for _, r in sorted(rows.items(),
                                             key=lambda kv: (kv[0][0], order[kv[0][1]]))]


def flat(values) -> np.ndarray:
    """All `values` (arrays or tensors) raveled into one float64 vector."""
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values])


class GradientSpy:
    """Records every execution of `methods` and the gradients each one received.

    `methods` are `(module, class, method, kind)` with `kind` in `GRADIENT_KINDS`;
    `reference` is the flat float64 gradient ratios are taken against. Set `step`
    (e.g. from a callback) to tag the calls. While a step is traced, each call adds
    a `tf.py_function` that records it *when it executes*, so a graph-mode
    `model.fit` is recorded execution by execution. (Eager `fit` would be simpler,
    but eager collectives under MirroredStrategy poison the collective-key cache of
    later strategies in the same process.)
    """

    def __init__(self, methods, reference):
        self.kinds = {tuple(m[:3]): m[3] for m in methods}
        for kind in self.kinds.values():
            if kind not in GRADIENT_KINDS:
                raise ValueError(f"kind must be one of {GRADIENT_KINDS}, got {kind!r}.")
        self.reference = np.asarray(reference, np.float64)
        self.calls: list[SpiedCall] = []
        self.traced: list[str] = []
        self.step = 0
        self._lock = threading.Lock()

    def installed(self):
        """A context manager: the methods spied on for the block."""
        return spying(self.kinds, self._before, self._after)

    def record(self) -> SpyRecord:
        return SpyRecord(tuple(self.calls), tuple(self.traced))

    def _before(self, spec, owner, args):
        kind, grads = self.kinds[spec], None
        if kind in ("pairs", "pairs+result"):
            pairs = list(args[0])
            args = (pairs,) + tuple(args[1:])
            grads = [g for g, _ in pairs]
        elif kind == "list":
            grads = list(args[0])
        elif kind == "single":
            grads = [args[0]]
        self._append(f"{type(owner).__name__}.{spec[2]}", grads, ratio=kind != "single")
        return args

    def _after(self, spec, owner, result):
        if self.kinds[spec] == "pairs+result":
            self._append(f"{type(owner).__name__}.{spec[2]} -> result",
                         [g for g, _ in result], ratio=True)

    def _append(self, function, grads, ratio):
        context = current_context()
        replica = None
        if context == "replica":
            replica = int(tf.get_static_value(
                tf.distribute.get_replica_context().replica_id_in_sync_group))
        present = [tf.convert_to_tensor(g) for g in (grads or []) if g is not None]
        dtypes = tuple(sorted({g.dtype.name for g in present}))
        if function not in self.traced:
            self.traced.append(function)

        def on_execution(*values):
            scale_seen = None
            if ratio and values:
                seen, ref = flat([v.numpy() for v in values]), self.reference
                scale_seen = (float(seen @ ref / (ref @ ref)) if np.all(np.isfinite(seen))
                              else float("nan"))
            with self._lock:
                self.calls.append(SpiedCall(self.step, function, context, replica, dtypes,
                                            scale_seen))
            return []

        if tf.executing_eagerly():
            on_execution(*present)
        else:
            tf.py_function(on_execution, present, Tout=[])
