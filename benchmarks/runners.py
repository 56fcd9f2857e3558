"""What every runner shares: sizes, the model, the data, and the `Runner` interface.

A runner trains for a number of *updates*; one update is `k` micro-batches of
`micro_batch` examples (global, over all replicas), whichever way the approach feeds
them. `benchmarks.fit_runners` and `benchmarks.loop_runners` hold the runners,
`benchmarks.approaches` which of them run in which group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from distgrad_course.lab.args import positive_int
from distgrad_course.pitfalls import CapturedError

LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model and timing sizes. `micro_batch` is global (all replicas together)."""

    features: int
    hidden: int
    layers: int
    micro_batch: int
    micro_batches_per_block: int  # micro-batches in one timed block
    repeats: int  # timed rounds of the main comparison
    scaling_repeats: int  # timed rounds of the scaling sweeps

    def block_updates(self, k: int) -> int:
        """Updates in one timed block: `micro_batches_per_block / k`, at least one."""
        return max(1, self.micro_batches_per_block // k)


PRESETS = {
    # Seconds: proves the pipeline, says nothing about performance.
    "quick": Sizes(features=16, hidden=32, layers=1, micro_batch=16,
                   micro_batches_per_block=4, repeats=2, scaling_repeats=2),
    # 2 CPU cores: ~5 GFLOP per micro-batch, so compute dominates the fixed cost of a
    # step (see the floor runners), and the whole run stays under 10 minutes.
    "cpu": Sizes(features=512, hidden=512, layers=4, micro_batch=512,
                 micro_batches_per_block=4, repeats=15, scaling_repeats=9),
    # A large GPU: ~1.6 TFLOP per micro-batch.
    "gpu": Sizes(features=4096, hidden=4096, layers=4, micro_batch=4096,
                 micro_batches_per_block=16, repeats=7, scaling_repeats=5),
}


def mlp(features: int, hidden: int, layers: int, seed: int = 0) -> keras.Model:
    """`layers` tanh Dense layers of `hidden` units and a Dense(1) output, seeded.

    The shape of `distgrad_course.lab.memory.wide_mlp`, as a plain functional model. Build it
    under the strategy scope.
    """
    inputs = keras.Input((features,))
    h = inputs
    for i in range(layers):
        h = keras.layers.Dense(hidden, activation="tanh",
                               kernel_initializer=keras.initializers.GlorotUniform(seed + i))(h)
    outputs = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.GlorotUniform(seed + layers))(h)
    return keras.Model(inputs, outputs)


def block_data(sizes: Sizes, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`(x, y)` for one timed block (at least one update) of micro-batches."""
    rows = sizes.micro_batch * k * sizes.block_updates(k)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, sizes.features)).astype("float32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    return x, y


def sgd(**kwargs):
    return keras.optimizers.SGD(LEARNING_RATE, **kwargs)


def sync_devices():
    """Wait for this process' devices: on GPUs a function call returns before its kernels
    finish.

    `tf.test.experimental.sync_devices` with the other workers' devices left out: it
    syncs every logical device, and on a multi-worker cluster those include the other
    workers', which it cannot reach ("Haven't set up remote eager worker"). A device name
    without `/job:` is local (one process, no cluster).
    """
    task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {})
    mine = f"/job:{task.get('type')}/replica:0/task:{task.get('index')}/"
    for device in tf.config.list_logical_devices():
        if "/job:" not in device.name or mine in device.name:
            with tf.device(device.name):
                tf.raw_ops.SyncDevice()
    context.async_wait()  # as tf.test.experimental.sync_devices: queued async ops


def variable_bytes(variable) -> int:
    """Bytes of one copy (one replica) of a tf/Keras variable."""
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    shape = inner.shape
    return int(np.prod(shape.as_list() if hasattr(shape, "as_list") else shape)) \
        * tf.as_dtype(inner.dtype).size


def accumulating_optimizer_state(optimizer) -> list:
    """An `AccumulatingOptimizer`'s buffers and its micro-step counter."""
    return optimizer.accumulators + [optimizer.total_micro_steps]


@dataclasses.dataclass
class Failed:
    """An approach that could not run here, and why."""

    key: str
    label: str
    path: str
    role: str
    ours: bool
    error: CapturedError | None = None
    reason: str | None = None  # when there is no exception (e.g. not applicable)


class Runner:
    """Common interface: `run(updates) -> seconds`, counters, all-reduce placement."""

    key = ""
    label = ""
    path = ""  # "fit" or "custom loop"
    role = "approach"  # "baseline" | "approach" | "reference" | "floor"
    ours = False
    hidden_units = None  # None: `sizes.hidden`; the floor runners use 1

    def __init__(self, strategy, sizes: Sizes, k: int, x, y):
        self.strategy = strategy
        self.sizes = sizes
        self.k = k
        self.x, self.y = x, y
        self.replicas = strategy.num_replicas_in_sync
        self.micro_batches_run = 0

    # -- to implement -----------------------------------------------------------------

    def _run(self, updates: int) -> float:
        raise NotImplementedError

    def placement(self) -> dict:
        """`{function: AllReducePlacement}` of each traced function the approach calls."""
        raise NotImplementedError

    def executions(self) -> dict[str, tuple[int, int]]:
        """`{function: (calls, conditional branch runs)}` so far, for the derived count."""
        raise NotImplementedError

    def state_variables(self) -> list:
        """Variables the approach adds on top of model and plain optimizer (buffers)."""
        return []

    # -- shared -----------------------------------------------------------------------

    def _model(self) -> keras.Model:
        hidden = self.hidden_units or self.sizes.hidden
        return mlp(self.sizes.features, hidden, 1 if self.hidden_units else self.sizes.layers)

    def run(self, updates: int) -> float:
        """Train `updates` updates (`updates * k` micro-batches); wall seconds, synced."""
        positive_int("updates", updates)
        needed = updates * self.k * self.sizes.micro_batch
        if needed > len(self.x):
            raise ValueError(f"{updates} updates need {needed} examples, the data has "
                             f"{len(self.x)}.")
        seconds = self._run(updates)
        self.micro_batches_run += updates * self.k
        return seconds

    def state_bytes_per_replica(self) -> int:
        return sum(variable_bytes(v) for v in self.state_variables())

    def describe(self) -> dict:
        return {"key": self.key, "label": self.label, "path": self.path, "role": self.role,
                "ours": self.ours}


def timed(calls) -> float:
    """Wall seconds of `calls()`, all devices synced before and after."""
    sync_devices()
    start = time.perf_counter()
    calls()
    sync_devices()
    return time.perf_counter() - start
