"""The GPU+XLA code path of `tf.distribute`, simulated on CPUs: no `merge_call`.

`MirroredStrategy` skips `merge_call` only when the step is XLA-compiled and every
replica is a GPU (`MirroredExtended._use_merge_call` in
`tensorflow/python/distribute/mirrored_strategy.py`; `CollectiveAllReduceExtended` for
`MultiWorkerMirroredStrategy` alike). Code then branches on
`tf.__internal__.distribute.strategy_supports_no_merge_call()`: Keras' optimizers
(`maybe_merge_call`), `LossScaleOptimizer._tf_apply`, TensorFlow's own
`ReplicaContext.all_reduce` and the replica-context update of mirrored variables.

`no_merge_call_strategy(replicas)` is a `MirroredStrategy` over logical CPU devices
whose `extended._use_merge_call` returns False: TensorFlow's own test fixture
(`strategy_combinations._mirrored_strategy_with_no_merge_call`). Every function traced
under it takes the no-merge-call branches.

What it reproduces of the GPU+XLA path: the Python that runs and the graph it builds.
Gradient all-reduces are `CollectiveReduceV2` ops launched in replica context
(`MirroredExtended._replica_ctx_all_reduce`), mirrored-variable updates run per replica
(`_replica_ctx_update`), and TensorFlow's constraints on that path hold: a collective
is allowed inside a replica-context `tf.cond` (every replica takes the same branch),
a `merge_call` is not (a variable with `ONLY_FIRST_REPLICA` aggregation, such as every
Keras optimizer's `iterations`, is still updated through one:
`values.apply_aggregation_replica_context`), and automatic control dependencies chain
resource-free stateful ops (a bare `tf.debugging.Assert`) across replicas in tracing
order, which can deadlock collectives in replica context.

What it cannot reproduce:
* XLA compilation. The simulated step runs as an ordinary graph. XLA cannot compile a
  step whose variables live on two devices ("Trying to access resource ... located in
  device CPU:1 from device CPU:0", the XLA known issue "tf.Variable on a different
  device"), so on CPUs `jit_compile=True` under a 2-replica strategy fails for every
  optimizer, Keras' own included; what XLA does with the same step on GPUs (which ops
  compile, that `tf.debugging.Assert` and `check_numerics` are compiled out) is seen
  here only on one device (`jit_compile=True` without a strategy, where
  `strategy_supports_no_merge_call()` is True as well).
* NCCL: the collectives run TensorFlow's RING implementation on CPUs; NCCL kernels,
  their reduction order and their timeouts are GPU-only.
* GPU memory: allocation, peaks and the memory a compiled step saves.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from distgrad_course.devices import replica_devices

# TensorFlow's fixture moves each new strategy's collective keys by this much, so that
# it cannot collide with a strategy over the same devices (see `make_strategy`).
_COLLECTIVE_KEY_OFFSET = 100_000
_STRATEGIES: dict = {}


def no_merge_call_strategy(replicas: int = 2) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` over `replicas` logical CPUs that takes the no-merge-call path.

    Created once per device set and process (like `distgrad_course.make_strategy`), with
    collective keys of its own, so that it cannot collide with `make_strategy`'s strategy
    over the same devices. As for `make_strategy`, the logical devices must exist before
    TensorFlow initializes.

    Raises:
        ValueError / RuntimeError: as `distgrad_course.devices.replica_devices`.
    """
    devices = tuple(replica_devices(replicas))
    if devices not in _STRATEGIES:
        cls = tf.distribute.MirroredStrategy
        previous = cls._collective_key_base
        cls._collective_key_base = previous + _COLLECTIVE_KEY_OFFSET * (len(_STRATEGIES) + 1)
        try:
            strategy = cls(list(devices))
        finally:
            cls._collective_key_base = previous
        strategy.extended._use_merge_call = lambda: False
        _STRATEGIES[devices] = strategy
    return _STRATEGIES[devices]


def takes_no_merge_call_path(strategy) -> bool:
    """`strategy_supports_no_merge_call()` as seen inside `strategy.run` of a traced step."""
    seen = []

    @tf.function
    def step():
        strategy.run(lambda: seen.append(
            bool(tf.__internal__.distribute.strategy_supports_no_merge_call())))

    step.get_concrete_function()
    return all(seen) and len(seen) == strategy.num_replicas_in_sync


@dataclasses.dataclass(frozen=True)
class LossScaleRecord:
    """Keras' `LossScaleOptimizer` on the no-merge-call path, one overflow on one replica.

    `error` is `None` or `{"type", "message"}` of what `fit` raised; `loss_scales` the
    `dynamic_scale` copies of each replica afterwards; `weights_finite` per weight.
    """

    replicas: int
    error: dict | None
    loss_scales: list
    weights_finite: list


def stock_loss_scale_overflow_on_one_replica(replicas: int = 2) -> LossScaleRecord:
    """`fit` under `mixed_float16` with Keras' `LossScaleOptimizer(SGD)` on
    `no_merge_call_strategy(replicas)`, replica 1's shard of step 1 overflowing float16.

    Meant for a child process (`distgrad_course.lab.child.run_child`, with a timeout): on this
    path the stock wrapper decides per replica, and a replica that skips the update
    while another all-reduces would wait forever.
    """
    import keras
    import numpy as np

    from distgrad_course.lab.data import tiny_model
    from distgrad_course.lab.mixed import mixed_precision_policy, overflow_data

    strategy = no_merge_call_strategy(replicas)
    global_batch = 4 * replicas
    x, y = overflow_data(2, global_batch, overflow_step=1, replicas=replicas,
                         overflow_replicas=(replicas - 1,))
    error = None
    with mixed_precision_policy("mixed_float16"):
        with strategy.scope():
            model = tiny_model()
            optimizer = keras.mixed_precision.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=2.0**10)
            model.compile(optimizer=optimizer, loss="mse")
        try:
            model.fit(x, y, batch_size=global_batch, shuffle=False, verbose=0)
        except Exception as err:  # the finding is what it raises
            error = {"type": type(err).__name__, "message": str(err)[:2000]}
    scale = model.optimizer.dynamic_scale.value
    copies = getattr(scale, "values", (scale,))
    return LossScaleRecord(
        replicas=replicas, error=error, loss_scales=[float(c.numpy()) for c in copies],
        weights_finite=[bool(np.all(np.isfinite(w))) for w in model.get_weights()])


def xla_step_on_two_cpu_replicas() -> dict:
    """`fit` of `tiny_model` with Keras' Adam under `jit_compile=True` on a real 2-replica
    `MirroredStrategy` over logical CPUs; returns `{"error": None | {"type", "message"}}`.

    For a child process: XLA cannot compile a step whose variables live on two devices,
    which is why the GPU+XLA path is simulated rather than compiled here.
    """
    import keras

    from distgrad_course.devices import make_strategy
    from distgrad_course.lab.data import regression_data, tiny_model

    strategy = make_strategy(2)
    x, y = regression_data(8)
    with strategy.scope():
        model = tiny_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
    try:
        model.fit(x, y, batch_size=8, verbose=0)
    except Exception as err:  # the finding is what it raises
        return {"error": {"type": type(err).__name__, "message": str(err)[-1500:]}}
    return {"error": None}
