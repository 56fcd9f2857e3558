"""Choose the devices a lesson runs on and build its `MirroredStrategy`.

Every lesson calls `make_strategy(replicas)` once, first thing. On a machine with GPUs
the replicas are GPUs; on a laptop or in CI they are *logical CPU devices*, which
TensorFlow can only create before its runtime initializes. That is why the call must
come before any other TensorFlow work, and why a late call fails with an error that
says how to fix it instead of silently running on one device.
"""

from __future__ import annotations

import dataclasses
import os
import platform

import tensorflow as tf

REPLICAS_ENV = "DISTGRAD_REPLICAS"
GPU_MEMORY_ENV = "DISTGRAD_GPU_MEMORY_MB"
DEFAULT_REPLICAS = 2
DEFAULT_GPU_MEMORY_MB = 4096
_STRATEGIES: dict = {}


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Which kind of device the replicas are, and whether logical devices are needed.

    `device_type` is "GPU" or "CPU"; `split` is True when one physical device must be
    split into `replicas` logical ones (all CPU runs, and GPU machines with fewer GPUs
    than replicas).
    """

    device_type: str
    replicas: int
    split: bool


def resolve_replicas(replicas: int | None = None) -> int:
    """The replica count to use: the argument, else `$DISTGRAD_REPLICAS`, else 2.

    Raises ValueError for a count below 1 or a non-integer environment value.
    """
    if replicas is None:
        raw = os.environ.get(REPLICAS_ENV, str(DEFAULT_REPLICAS))
        try:
            replicas = int(raw)
        except ValueError:
            raise ValueError(f"{REPLICAS_ENV} must be a whole number, got {raw!r}.") from None
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}.")
    return replicas


def plan_devices(replicas: int, physical_gpus: int) -> DevicePlan:
    """Decide where `replicas` replicas live given how many physical GPUs are visible.

    Pure function (no TensorFlow calls) so the GPU branches are tested on CPU machines.
    """
    replicas = resolve_replicas(replicas)
    if physical_gpus >= replicas:
        return DevicePlan("GPU", replicas, split=False)
    if physical_gpus >= 1:
        # One GPU, two replicas: split it. MirroredStrategy then uses RING collectives
        # (tensorflow/python/distribute/mirrored_strategy.py, virtual devices branch).
        return DevicePlan("GPU", replicas, split=True)
    return DevicePlan("CPU", replicas, split=replicas > 1)


def _configure_logical_devices(plan: DevicePlan) -> None:
    device = tf.config.list_physical_devices(plan.device_type)[0]
    present = tf.config.get_logical_device_configuration(device)
    if present is not None and len(present) >= plan.replicas:
        return
    if plan.device_type == "GPU":
        memory_mb = int(os.environ.get(GPU_MEMORY_ENV, DEFAULT_GPU_MEMORY_MB))
        configs = [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)] * plan.replicas
    else:
        configs = [tf.config.LogicalDeviceConfiguration()] * plan.replicas
    try:
        tf.config.set_logical_device_configuration(device, configs)
    except RuntimeError as err:
        have = len(tf.config.list_logical_devices(plan.device_type))
        raise RuntimeError(
            f"distgrad_course.make_strategy({plan.replicas}) needs {plan.replicas} logical "
            f"{plan.device_type} devices, but the TensorFlow runtime is already initialized "
            f"with {have}. Logical devices can only be created before the first TensorFlow "
            "operation: restart the kernel (or process) and call distgrad_course.make_strategy() "
            "before anything else touches TensorFlow, or ask for fewer replicas "
            f"(e.g. {REPLICAS_ENV}={have})."
        ) from err


def replica_devices(replicas: int | None = None) -> list[str]:
    """Configure (if needed) and return the device names for `replicas` replicas."""
    replicas = resolve_replicas(replicas)
    gpus = tf.config.list_physical_devices("GPU")
    plan = plan_devices(replicas, len(gpus))
    if plan.split:
        _configure_logical_devices(plan)
    elif plan.device_type == "GPU":
        # Whole GPUs: allocate as needed rather than all memory up front, so that several
        # processes (test workers, lesson kernels, workers of a local cluster) share them.
        for gpu in gpus:
            if tf.config.get_logical_device_configuration(gpu) is None:
                try:
                    tf.config.experimental.set_memory_growth(gpu, True)
                except RuntimeError:  # the runtime has started: it keeps what it chose
                    pass
    devices = [d.name for d in tf.config.list_logical_devices(plan.device_type)]
    if len(devices) < replicas:
        raise RuntimeError(
            f"distgrad_course.make_strategy({replicas}) found only {len(devices)} logical "
            f"{plan.device_type} device(s) and the runtime is already initialized. Restart "
            "the kernel (or process) and call distgrad_course.make_strategy() first, or ask for "
            f"fewer replicas (e.g. {REPLICAS_ENV}={len(devices)})."
        )
    return devices[:replicas]


def make_strategy(replicas: int | None = None) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` over `replicas` GPUs, or over `replicas` logical CPU devices.

    `replicas=None` reads `$DISTGRAD_REPLICAS` (default 2). Call it before any other
    TensorFlow work: logical devices cannot be added once the runtime is initialized.
    Asking later for *fewer* replicas than exist is fine (e.g. `make_strategy(1)` for a
    single-device reference after `make_strategy(2)`). Disables TensorFloat-32 matmuls
    (a GPU-only precision shortcut) so float32 results stay comparable at 1e-6.
    Returns the same strategy object for the same devices (see the comment inside).

    Raises:
        ValueError: `replicas` < 1.
        RuntimeError: the runtime is already initialized with too few devices; the
            message says to restart and call `make_strategy` first.
    """
    devices = tuple(replica_devices(replicas))
    # TensorFloat-32 (on by default on Ampere and newer GPUs) rounds matmul inputs to a
    # 10-bit mantissa: float32 equivalence checks at 1e-6 would fail for that reason alone.
    tf.config.experimental.enable_tensor_float_32_execution(False)
    # One strategy per device set and process: every new MirroredStrategy numbers its
    # collectives from the same keys (MirroredExtended._make_collective_ops_with_fallbacks),
    # so a second one over the same devices can collide with the first ("Shape mismatch
    # in the collective instance") and poison every later all-reduce in the process.
    if devices not in _STRATEGIES:
        # Quiet TensorFlow's INFO line naming every device: environment_report shows them.
        logger, level = tf.get_logger(), tf.get_logger().level
        logger.setLevel("WARNING")
        try:
            _STRATEGIES[devices] = tf.distribute.MirroredStrategy(list(devices))
        finally:
            logger.setLevel(level)
    return _STRATEGIES[devices]


def environment_report(strategy: tf.distribute.Strategy | None = None) -> dict:
    """Versions and devices, printed at the top of every lesson."""
    import keras

    report = {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "physical_gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
        "tensor_float_32": tf.config.experimental.tensor_float_32_execution_enabled(),
    }
    if strategy is not None:
        report["strategy"] = type(strategy).__name__
        report["replicas"] = strategy.num_replicas_in_sync
        report["devices"] = list(strategy.extended.worker_devices)
        report["cross_device_ops"] = type(strategy.extended._cross_device_ops).__name__
    return report
