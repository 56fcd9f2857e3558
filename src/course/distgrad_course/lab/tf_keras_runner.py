"""Run a function of a real module under legacy `tf-keras` (Keras 2) in a new process.

Many questions this course answers were asked in the Keras 2 era (`tf.keras` before
TensorFlow 2.16). TensorFlow still ships that behaviour as the separate `tf-keras`
package, selected by the environment variable `TF_USE_LEGACY_KERAS=1` -- but the
variable is read when TensorFlow is *imported* (`tensorflow/python/util/lazy_loader.py`,
`KerasLazyLoader`), so a process that already imported TensorFlow with Keras 3 cannot
switch. `run_tf_keras("package.module:function", replicas, **kwargs)` therefore calls
`function(replicas=replicas, **kwargs)` in a child (`distgrad_course.lab.child`) with the
variable set, and returns its value with the versions it ran on.

The function's module is imported only in the child, so it may be tf-keras code
through and through (`distgrad_course.pitfalls.tf_keras_loss_scale`). The function must build
its strategy first, before other TensorFlow work: `strategy = tf_keras_strategy(replicas)`.
Batch several observations into one function: each child pays TensorFlow's start-up
(several seconds).

This module imports only the standard library (it is imported in both processes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from distgrad_course.lab.args import positive_int
from distgrad_course.lab.child import (
    DEFAULT_TIMEOUT_S,
    ChildError,
    check_target,
    check_timeout,
    run_child,
)

LEGACY_ENV = "TF_USE_LEGACY_KERAS"
_built: dict = {}  # in the child: the strategy `tf_keras_strategy` made


@dataclasses.dataclass(frozen=True)
class TfKerasResult:
    """What the tf-keras function returned (`value`, as JSON: non-finite floats are the
    strings "nan", "inf", "-inf"), and what it ran on: TensorFlow and tf-keras
    versions, the replicas of the strategy `tf_keras_strategy` built (None if it was not
    called), the child's wall time. `result[key]` is `result.value[key]`."""

    tensorflow: str
    tf_keras: str
    replicas: int | None
    value: object
    seconds: float

    def __getitem__(self, key):
        return self.value[key]


def tf_keras_available() -> bool:
    """True if the `tf_keras` package is importable in this environment."""
    return importlib.util.find_spec("tf_keras") is not None


def _check_tf_keras():
    """The tf_keras module, after checking that `tf.keras` is it in this process; or, in a
    child run without the switch on TensorFlow <= 2.15, the `keras` 2.x that is tf.keras."""
    import tensorflow as tf

    if (os.environ.get(LEGACY_ENV) is None
            and tf.keras.Model.__module__.startswith("keras.src.engine.")):
        import keras  # TensorFlow <= 2.15's own Keras 2

        return keras
    if os.environ.get(LEGACY_ENV) != "1":
        raise RuntimeError(f"{LEGACY_ENV}=1 must be set before TensorFlow is imported; "
                           "call this through run_tf_keras.")
    import tf_keras

    if not tf.keras.Model.__module__.startswith("tf_keras"):
        raise RuntimeError(f"tf.keras is {tf.keras.Model.__module__}, not tf-keras.")
    return tf_keras


def tf_keras_strategy(replicas: int = 1):
    """In a tf-keras child: a `MirroredStrategy` over `replicas` devices; call it first.

    The devices `distgrad_course.make_strategy` would use
    (`distgrad_course.devices.replica_devices`:
    GPUs, a split GPU, or logical CPU devices, which must be configured before
    TensorFlow initializes its runtime), with TF32 off as there. Raises RuntimeError
    outside a `run_tf_keras` child (tf.keras is not tf-keras).
    """
    import tensorflow as tf

    from distgrad_course.devices import replica_devices

    devices = replica_devices(replicas)
    tf.config.experimental.enable_tensor_float_32_execution(False)
    strategy = tf.distribute.MirroredStrategy(devices)
    _check_tf_keras()
    _built["strategy"] = strategy
    return strategy


def _call_in_child(target: str, replicas: int, kwargs: dict) -> dict:
    from distgrad_course.lab.child import resolve

    value = resolve(target)(replicas=replicas, **kwargs)
    import tensorflow as tf

    strategy = _built.get("strategy")
    return {"tensorflow": tf.__version__, "tf_keras": _check_tf_keras().__version__,
            "replicas": None if strategy is None else strategy.num_replicas_in_sync,
            "value": value}


def run_tf_keras(target: str, replicas: int = 1, timeout: float = DEFAULT_TIMEOUT_S,
               env: dict | None = None, **kwargs) -> TfKerasResult:
    """Call `target(replicas=replicas, **kwargs)` under tf-keras in a child Python.

    `target` is `"package.module:function"`, imported only in the child, which has
    `TF_USE_LEGACY_KERAS=1` (and `env`) in its environment before TensorFlow is
    imported (`env={"TF_USE_LEGACY_KERAS": None}` runs it without the switch: on
    TensorFlow <= 2.15, whose own tf.keras is Keras 2). `kwargs` must be
    JSON-serializable; so must the return value, after numpy/tensor conversion
    (`distgrad_course.lab.child.to_json`).

    Raises:
        TypeError / ValueError: a malformed target, `replicas` not an integer >= 1, or
            `timeout` <= 0 (checked before a child starts).
        ImportError: tf-keras is not installed (`pip install tf-keras`, the same minor
            version as tensorflow).
        ChildError: the function raised (the message has its type, message and the
            child's stderr tail) or the child exited without a result.
        TimeoutError: the child ran longer than `timeout` seconds (it is killed).
    """
    check_target(target)
    positive_int("replicas", replicas)
    timeout = check_timeout(timeout)
    env = {LEGACY_ENV: "1", **(env or {})}  # {LEGACY_ENV: None}: TF <= 2.15's own tf.keras
    if env[LEGACY_ENV] is not None and not tf_keras_available():
        raise ImportError("tf-keras is not installed, so legacy Keras 2 cannot be run: "
                          "`pip install tf-keras` (the same minor version as tensorflow).")
    try:
        result = run_child("distgrad_course.lab.tf_keras_runner:_call_in_child",
                           {"target": target, "replicas": replicas, "kwargs": kwargs},
                           env=env, timeout=timeout)
    except ChildError as err:
        raise ChildError(f"{target} under tf-keras: {err}") from None
    value = result.value
    return TfKerasResult(value["tensorflow"], value["tf_keras"], value["replicas"],
                        value["value"], result.seconds)
