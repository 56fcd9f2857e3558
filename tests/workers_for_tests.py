"""Child targets used only by tests: of the runners themselves (`distgrad.lab.child`,
`distgrad.lab.multiworker`, `distgrad.lab.legacy`) and of what needs a fresh runtime. Children find this module through
`PYTHONPATH` (see `TESTS_ON_PATH` in the tests); TensorFlow is imported only where
a target needs it, so the other children start in a fraction of a second."""

import dataclasses
import os
import resource
import time


def sleep_forever(task_index, num_workers, pid_file):
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1)


@dataclasses.dataclass(frozen=True)
class Pair:
    name: str
    value: float


def plain_values(**kwargs):
    """Values of every kind `to_json` converts, and the kwargs it was called with."""
    import numpy as np

    return {"kwargs": kwargs, "array": np.arange(3, dtype=np.float32),
            "scalar": np.float64(0.5), "flag": np.bool_(True), "nan": float("nan"),
            "infinities": [float("inf"), float("-inf")], "pair": Pair("a", 1.5),
            "env": os.environ.get("DISTGRAD_TEST_VARIABLE")}


def peak_rss_kib():
    """This process' lifetime peak RSS (`ru_maxrss`, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def raise_marker(marker, replicas=None):
    raise ValueError(marker)


def exit_without_result(code=0, replicas=None):
    os._exit(code)


def sleep_for(seconds=60, replicas=None):
    time.sleep(seconds)


def legacy_probe(replicas):
    """Under tf-keras: what the child's `tf.keras` and strategy are."""
    from distgrad.lab.legacy import legacy_strategy

    strategy = legacy_strategy(replicas)
    import numpy as np
    import tensorflow as tf

    optimizer = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.legacy.SGD(0.1))
    return {"env": os.environ.get("TF_USE_LEGACY_KERAS"),
            "model_module": tf.keras.Model.__module__,
            "lso_class": type(optimizer).__name__,
            "initial_scale": optimizer.loss_scale,
            "in_sync": strategy.num_replicas_in_sync,
            "not_a_number": float("nan"),
            "numpy_values": np.arange(3, dtype=np.float32)}


def strategy_after_runtime_init():
    """`make_strategy(2)` after TensorFlow's runtime started with one CPU device."""
    import tensorflow as tf

    tf.constant(1.0) + 1.0  # initializes the runtime with one CPU device
    from distgrad.devices import make_strategy

    make_strategy(2)


def replicas_in_sync():
    """`make_strategy()`'s replica count (it reads DISTGRAD_REPLICAS)."""
    from distgrad.devices import make_strategy

    return make_strategy().num_replicas_in_sync
