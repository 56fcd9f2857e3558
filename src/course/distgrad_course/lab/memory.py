"""Peak memory of a training step: TensorFlow's allocator statistic and process peak RSS.

Two different numbers, and what each one measures:

* **Allocator peak** (`tf.config.experimental.get_memory_info(device)["peak"]`, reset
  with `reset_memory_stats`): the largest number of bytes TensorFlow's allocator had
  handed out for tensors on `device` since the reset. On a GPU that is the GPU
  memory your batch size is limited by (per device; with logical GPUs, per logical
  device). On CPU, TensorFlow's CPU allocator keeps the same statistic, and *all
  logical CPU devices share one allocator*, so "CPU:0" is the whole process' tensor
  memory for every replica together. It counts tensors only: not the Python heap,
  not graphs, not library scratch space outside TensorFlow's allocator.
  `step_bytes = peak - current_before` is what one step adds on top of what was
  already live (weights, optimizer slots, the input batch). Observed on TF 2.21's
  CPU allocator: small tensors are not counted at all (a 128 KiB tensor reads 0, a
  256 KiB one is counted; `allocator_counts` probes it), so on CPU the statistic is a
  lower bound dominated by large activations, which is what micro-batching changes.
* **Peak RSS** (`getrusage(RUSAGE_SELF).ru_maxrss`): the most resident memory the
  *process* ever had: the TensorFlow runtime (hundreds of MB), Python, traced
  graphs, every tensor. It is a lifetime maximum that never goes down, so comparing
  configurations needs a fresh process for each (`fresh_process_step_memory`), and
  a difference of tens of MB sits on top of a large, slightly noisy base.

Both are exposed; the GPU/CPU choice is a pure function (`allocator_device`) so the GPU
branch is unit-tested on CPU machines.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import time

from distgrad_course.lab.args import positive_int
from distgrad_course.lab.child import run_child


def ru_maxrss_bytes(ru_maxrss: int, system: str | None = None) -> int:
    """`ru_maxrss` in bytes: Linux and the BSDs report KiB, macOS reports bytes."""
    system = platform.system() if system is None else system
    return int(ru_maxrss) if system == "Darwin" else int(ru_maxrss) * 1024


def peak_rss_bytes() -> int:
    """The process' lifetime peak resident set size, in bytes."""
    return ru_maxrss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def current_rss_bytes() -> int:
    """The process' resident set size now, in bytes (psutil)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def allocator_device(physical_gpus: int) -> str:
    """Where the allocator statistic is read: "GPU:0" with GPUs, else "CPU:0".

    Pure function. On GPUs it is the first (logical) GPU, i.e. replica 0's memory;
    on CPU the one allocator that every logical CPU device shares.
    """
    if physical_gpus < 0:
        raise ValueError(f"physical_gpus must be >= 0, got {physical_gpus}.")
    return "GPU:0" if physical_gpus else "CPU:0"


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Allocator bytes around one measured call: live before, peak during."""

    device: str
    current_before: int
    peak: int

    @property
    def step_bytes(self) -> int:
        """Bytes the call needed on top of what was live before it."""
        return self.peak - self.current_before


def step_memory_from_info(device: str, before: dict, after: dict) -> StepMemory:
    """Build a `StepMemory` from two `get_memory_info` dicts (pure; validates them).

    Raises ValueError when a dict lacks "current"/"peak" or the peak is below the
    starting value (stats were not reset before the call).
    """
    for name, info in (("before", before), ("after", after)):
        if not {"current", "peak"} <= set(info):
            raise ValueError(f"memory info {name} needs 'current' and 'peak', got {sorted(info)}.")
    if after["peak"] < before["current"]:
        raise ValueError(
            f"peak {after['peak']} < bytes live before ({before['current']}): call "
            "tf.config.experimental.reset_memory_stats(device) right before measuring.")
    return StepMemory(device, int(before["current"]), int(after["peak"]))


def measure_step_memory(fn, device: str | None = None) -> StepMemory:
    """Run `fn()` and return the allocator's live-before and peak bytes on `device`.

    `device=None` picks `allocator_device(number of physical GPUs)`.
    """
    import tensorflow as tf

    if device is None:
        device = allocator_device(len(tf.config.list_physical_devices("GPU")))
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as err:
        raise RuntimeError(
            f"{err}: this TensorFlow keeps no allocator statistics for {device}. On a CPU "
            "they need oneDNN: set TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow is imported "
            "(TensorFlow enables it by itself only on CPUs with AVX-512).") from err
    before = tf.config.experimental.get_memory_info(device)
    fn()
    after = tf.config.experimental.get_memory_info(device)
    return step_memory_from_info(device, before, after)


def allocator_counts(nbytes: int, device: str = "CPU:0") -> bool:
    """Whether the allocator statistic on `device` sees a temporary of `nbytes` bytes
    (the temporary is placed on `device`, also where a GPU would be the default)."""
    import tensorflow as tf

    def temporary():
        with tf.device(device):
            return float(tf.reduce_sum(tf.ones([max(1, nbytes // 4)], tf.float32)))

    step = measure_step_memory(temporary, device)
    return step.step_bytes >= nbytes // 4 * 4


# --- one workload, measured in a fresh process ---------------------------------------


@dataclasses.dataclass(frozen=True)
class FreshProcessMeasurement:
    """What `fresh_process_step_memory` measured for one `accumulation_steps` setting.

    `rss_before` / `rss_peak`: current RSS before the first `fit` and the lifetime
    peak after it (tracing included). `step`: allocator bytes of one steady-state
    step. `step_seconds`: the fastest of `timed_steps` steady-state steps.
    """

    accumulation_steps: int
    replicas: int
    batch_size: int
    rss_before: int
    rss_peak: int
    step: StepMemory
    step_seconds: float

    @property
    def rss_growth(self) -> int:
        """`rss_peak - rss_before`: how far the process' resident memory rose above its
        level before the first `fit` (tracing included), as the OS counts it."""
        return self.rss_peak - self.rss_before


def wide_mlp(features: int, hidden: int, layers: int, accumulation_steps: int,
             non_finite: str = "raise"):
    """A `MicroBatchingModel` tanh MLP (`layers` x `hidden`) compiled with SGD and MSE.

    Wide on purpose: its backward pass keeps `layers` activations of shape
    (batch, hidden) alive, which is what micro-batching shrinks. Build it under the
    strategy scope.
    """
    import keras

    from distgrad.train_step import MicroBatchingModel

    inputs = keras.Input((features,))
    h = inputs
    for _ in range(layers):
        h = keras.layers.Dense(hidden, activation="tanh")(h)
    model = MicroBatchingModel(inputs, keras.layers.Dense(1)(h),
                               accumulation_steps=accumulation_steps, non_finite=non_finite)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def profile_fit_step(model, x, y, batch_size: int, timed_steps: int = 3,
                     device: str | None = None) -> tuple[StepMemory, float]:
    """(allocator memory of one `fit` step, seconds of the fastest of `timed_steps` steps).

    `x`, `y` hold exactly one global batch of `batch_size`. Call after a first `fit`
    (tracing is neither measured nor timed). Each timed step is its own one-step
    `fit` call (Keras' per-call overhead included, the same for every model); the
    minimum is the measurement least disturbed by other load on a shared machine.
    """
    positive_int("timed_steps", timed_steps)
    step = measure_step_memory(
        lambda: model.fit(x, y, batch_size=batch_size, verbose=0), device)
    times = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, verbose=0)
        times.append(time.perf_counter() - start)
    return step, min(times)


def workload(accumulation_steps: int, batch_size: int, features: int, hidden: int,
             layers: int, replicas: int, timed_steps: int) -> dict:
    """In a fresh process: fit `wide_mlp` once, then measure; the fields of
    `FreshProcessMeasurement` as a dict (what `fresh_process_step_memory` runs)."""
    from distgrad_course.devices import make_strategy

    strategy = make_strategy(replicas)
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, features)).astype("float32")
    y = rng.normal(size=(batch_size, 1)).astype("float32")
    with strategy.scope():
        model = wide_mlp(features, hidden, layers, accumulation_steps)
    rss_before = current_rss_bytes()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)  # trace + first step
    rss_peak = peak_rss_bytes()
    step, seconds = profile_fit_step(model, x, y, batch_size, timed_steps)
    return {"accumulation_steps": accumulation_steps, "replicas": replicas,
            "batch_size": batch_size, "rss_before": rss_before, "rss_peak": rss_peak,
            "step": dataclasses.asdict(step), "step_seconds": seconds}


def fresh_process_step_memory(accumulation_steps: int, batch_size: int = 2048,
                              features: int = 256, hidden: int = 1024, layers: int = 3,
                              replicas: int = 1, timed_steps: int = 3,
                              timeout: float = 300) -> FreshProcessMeasurement:
    """Train a wide tanh MLP with `MicroBatchingModel` in a new Python process; measure.

    One global batch of `batch_size` examples per step, `accumulation_steps` slices per
    replica. A new process per call (`distgrad_course.lab.child`, started through a trampoline
    so that its peak RSS is its own, not this process'), so the peak RSS belongs to
    this configuration only. The child runs with oneDNN on (`TF_ENABLE_ONEDNN_OPTS=1`
    unless set here): TensorFlow enables it by default only on some CPUs, and without
    it the CPU allocator keeps no statistic to read. Raises `ChildError` (a RuntimeError)
    with the child's stderr tail if it fails, TimeoutError past `timeout` seconds.
    """
    record = run_child("distgrad_course.lab.memory:workload", {
        "accumulation_steps": accumulation_steps, "batch_size": batch_size,
        "features": features, "hidden": hidden, "layers": layers, "replicas": replicas,
        "timed_steps": timed_steps}, timeout=timeout, trampoline=True,
        env={"TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1")}).value
    record["step"] = StepMemory(**record["step"])
    return FreshProcessMeasurement(**record)
