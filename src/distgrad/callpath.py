"""Record which synchronization-relevant functions run, and in which context.

`record_sync_path(fn)` temporarily wraps a fixed list of TensorFlow and Keras
functions (the ones on the path from `optimizer.apply_gradients` to the variable
update), runs `fn`, and returns one `SyncEvent` per call with the distribution
context it ran in. Because a `tf.function` runs its Python only while tracing, call
`fn` on a fresh `tf.function` (or eagerly) to see the path.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import threading

import tensorflow as tf

# (module, class, method): the places where a gradient's journey changes context.
SYNC_PATH_FUNCTIONS = (
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply_gradients"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", "_clip_gradients"),
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer", "_backend_update_step"),
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer", "_all_reduce_sum_gradients"),
    ("tensorflow.python.distribute.distribute_lib", "ReplicaContext", "all_reduce"),
    ("tensorflow.python.distribute.distribute_lib", "ReplicaContext", "merge_call"),
    ("tensorflow.python.distribute.distribute_lib", "StrategyExtendedV2", "batch_reduce_to"),
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer", "_distributed_tf_update_step"),
    ("tensorflow.python.distribute.distribute_lib", "StrategyExtendedV2", "update"),
    ("keras.src.optimizers.sgd", "SGD", "update_step"),
    ("keras.src.optimizers.adam", "Adam", "update_step"),
)


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


def current_context() -> str:
    """ "replica", "cross-replica" or "default" for the code running now."""
    if tf.distribute.in_cross_replica_context():
        return "cross-replica"
    if not tf.distribute.has_strategy():
        return "default"
    return "replica"


@contextlib.contextmanager
def _wrapped(functions, events, lock):
    originals = []
    try:
        for module_name, class_name, method_name in functions:
            named = getattr(importlib.import_module(module_name), class_name)
            # Patch the class that defines the method (it may be a base class).
            cls = next(c for c in named.__mro__ if method_name in c.__dict__)
            original = cls.__dict__[method_name]
            originals.append((cls, method_name, original))

            def spy(*args, __original=original, __name=f"{class_name}.{method_name}", **kwargs):
                with lock:
                    events.append(
                        SyncEvent(__name, current_context(), threading.current_thread().name)
                    )
                return __original(*args, **kwargs)

            if (cls, method_name) in {(c, m) for c, m, _ in originals[:-1]}:
                originals.pop()  # already spied on through another name
                continue
            setattr(cls, method_name, spy)
        yield
    finally:
        for cls, method_name, original in reversed(originals):
            setattr(cls, method_name, original)


def record_sync_path(fn, *args, functions=SYNC_PATH_FUNCTIONS, **kwargs):
    """Run `fn(*args, **kwargs)` with the sync-path functions spied on.

    Returns `(result, events)`; `events` lists every spied call in order.
    """
    events: list[SyncEvent] = []
    with _wrapped(functions, events, threading.Lock()):
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
