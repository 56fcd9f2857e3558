"""One runner per way of training, all on the same MLP, data, optimizer and strategy.

A runner trains for a number of *updates*; one update is `k` micro-batches of
`micro_batch` examples (global, over all replicas), whichever way the approach feeds
them. The plain runners make one optimizer step per micro-batch (the "plain
micro-batch step" every overhead is measured against); "plain B" makes one step per
update on the whole batch of `k * micro_batch` (no accumulation, `k` times the
activation memory).

| key | how it trains | path |
|---|---|---|
| `plain_fit` | `model.fit(batch_size=micro_batch)`, SGD | fit (baseline) |
| `plain_big_fit` | `model.fit(batch_size=k * micro_batch)` | fit (reference) |
| `accumulating_optimizer_fit` | `distgrad.optimizer.AccumulatingOptimizer(SGD, k)` in fit | fit |
| `micro_batching_fit` | `distgrad.train_step.with_micro_batches(model, k)`, batch k*micro | fit |
| `keras_builtin_fit` | `keras.optimizers.SGD(gradient_accumulation_steps=k)` | fit |
| `mask_trick_fit` | `distgrad.pitfalls.mask_trick.patch_with_mask` (apply `acc * 0/1`) | fit |
| `pypi_gradient_accumulator_fit` | PyPI `gradient-accumulator`'s `GradientAccumulateModel` | fit |
| `plain_custom` | `strategy.run(distgrad.sync.make_replica_step(...))` per micro-batch | custom loop (baseline) |
| `gradient_accumulator_custom` | `distgrad.accumulator.AccumulatedTrainer` (k accumulate calls, 1 apply) | custom loop |
| `accumulating_optimizer_custom` | `plain_custom` with an `AccumulatingOptimizer` | custom loop |
| `floor_fit`, `floor_custom` | the plain runners on a model with one hidden unit | fixed per-step cost |

Every model is built, compiled (`jit_compile=False`, so CPU and GPU runs compile the
same way) and traced before it is timed. A runner that cannot run (Keras' built-in
accumulation and the PyPI package under `MirroredStrategy`, the package when it is not
installed) is returned as a `Failed` record with the exception it raised.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from distgrad.lab.accumulation import AccumulatedTrainer
from distgrad.lab.graph import AllReducePlacement, all_reduce_placement, fit_step_placement
from distgrad.lab.recipes import make_replica_step
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.pitfalls import CapturedError
from distgrad.pitfalls.mask_trick import patch_with_mask
from distgrad.train_step import with_micro_batches

LEARNING_RATE = 1e-3
PYPI_PACKAGE = "gradient-accumulator"


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

    The shape of `distgrad.memory.wide_mlp`, as a plain functional model. Build it
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


def _sgd(**kwargs):
    return keras.optimizers.SGD(LEARNING_RATE, **kwargs)


def _sync():
    # Wait for every device: on GPUs a function call returns before its kernels finish.
    tf.test.experimental.sync_devices()


def _variable_bytes(variable) -> int:
    """Bytes of one copy (one replica) of a tf/Keras variable."""
    inner = variable.value if isinstance(variable, keras.Variable) else variable
    shape = inner.shape
    return int(np.prod(shape.as_list() if hasattr(shape, "as_list") else shape)) \
        * tf.as_dtype(inner.dtype).size


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

    def placement(self) -> dict[str, AllReducePlacement]:
        """All-reduce placement of each traced function the approach calls."""
        raise NotImplementedError

    def executions(self) -> dict[str, tuple[int, int]]:
        """`{function: (calls, conditional branch runs)}` so far, for the derived count."""
        raise NotImplementedError

    def state_variables(self) -> list:
        """Variables the approach adds on top of model and plain optimizer (buffers)."""
        return []

    # -- shared -----------------------------------------------------------------------

    def run(self, updates: int) -> float:
        """Train `updates` updates (`updates * k` micro-batches); wall seconds, synced."""
        if updates < 1:
            raise ValueError(f"updates must be >= 1, got {updates}.")
        needed = updates * self.k * self.sizes.micro_batch
        if needed > len(self.x):
            raise ValueError(f"{updates} updates need {needed} examples, the data has {len(self.x)}.")
        seconds = self._run(updates)
        self.micro_batches_run += updates * self.k
        return seconds

    def state_bytes_per_replica(self) -> int:
        return sum(_variable_bytes(v) for v in self.state_variables())

    def describe(self) -> dict:
        return {"key": self.key, "label": self.label, "path": self.path, "role": self.role,
                "ours": self.ours}


# --- fit ------------------------------------------------------------------------------


class FitRunner(Runner):
    """A compiled model, run the way `model.fit` runs it, step by step.

    Built and trained once with `model.fit` on one update's data (proof that it runs in
    fit; this traces fit's train function). Timed: `model.train_function(...)`, the call
    fit makes once per step (`TensorFlowTrainer.fit` -> `train_function` ->
    `one_step_on_data`: `strategy.run(train_step)` + `reduce_per_replica`), fed the
    block's batches distributed once beforehand, as the custom loops are. Fit's per-call
    setup (data adapter, distributed dataset, iterator start-up: about half a second per
    call under MirroredStrategy on CPU), its input pipeline and its per-step callbacks
    are left out: they are amortized over an epoch in real training, and they are the
    same for every approach.
    """

    path = "fit"
    batch_multiple = 1  # fit's batch_size in micro-batches

    def __init__(self, strategy, sizes, k, x, y):
        super().__init__(strategy, sizes, k, x, y)
        if k % self.batch_multiple:
            raise ValueError(f"k={k} is not a multiple of {self.batch_multiple} micro-batches.")
        self.steps = 0
        with strategy.scope():
            self.model = self._build()
        self.batch_size = self.batch_multiple * sizes.micro_batch
        rows = k * sizes.micro_batch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model.fit(x[:rows], y[:rows], batch_size=self.batch_size, epochs=1,
                           shuffle=False, verbose=0)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
            self.batch_size, drop_remainder=True)
        # A finite list, not a live iterator: a distributed iterator kept alive (and
        # profiled) takes seconds to tear down.
        self.batches = list(strategy.experimental_distribute_dataset(dataset))
        self.run(1)  # traces the step for these (static) shapes

    def _build(self) -> keras.Model:
        raise NotImplementedError

    def _model(self):
        return mlp(self.sizes.features, self.sizes.hidden, self.sizes.layers)

    def _run(self, updates):
        steps = updates * self.k // self.batch_multiple
        train_function, batches = self.model.train_function, self.batches
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _sync()
            start = time.perf_counter()
            for step in range(steps):
                # A Python iterator: train_function then calls one_step_on_data(batch).
                train_function(iter((batches[step % len(batches)],)))
            _sync()
            seconds = time.perf_counter() - start
        self.steps += steps
        return seconds

    def placement(self):
        n = self.batch_size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {"step": fit_step_placement(self.model, self.x[:n], self.y[:n], n)}

    def executions(self):
        return {"step": (self.steps, 0)}


class PlainFit(FitRunner):
    key, label, role = "plain_fit", "plain micro-batch step", "baseline"

    def _build(self):
        model = self._model()
        model.compile(_sgd(), "mse", jit_compile=False)
        return model

    def __init__(self, strategy, sizes, k, x, y):
        # The plain step does not depend on k: it trains on micro-batches, one update
        # each. `k` only groups them (k micro-batches = one accumulated update).
        super().__init__(strategy, sizes, k, x, y)


class PlainBigFit(PlainFit):
    key, label, role = "plain_big_fit", "plain step on the whole batch B", "reference"

    def __init__(self, strategy, sizes, k, x, y):
        self.batch_multiple = k
        super().__init__(strategy, sizes, k, x, y)


class FloorFit(PlainFit):
    key, label, role = "floor_fit", "plain step, model with 1 hidden unit", "floor"

    def _model(self):
        return mlp(self.sizes.features, 1, 1)


class AccumulatingOptimizerFit(FitRunner):
    key, label, ours = "accumulating_optimizer_fit", "AccumulatingOptimizer", True

    def _build(self):
        model = self._model()
        model.compile(AccumulatingOptimizer(_sgd(), accumulation_steps=self.k), "mse", jit_compile=False)
        return model

    def executions(self):
        updates = int(self.model.optimizer.iterations.numpy())
        return {"step": (self.steps, updates)}

    def state_variables(self):
        return self.model.optimizer.accumulators + [self.model.optimizer.total_micro_steps]


class MicroBatchingFit(FitRunner):
    key, label, ours = "micro_batching_fit", "MicroBatching train_step", True

    def __init__(self, strategy, sizes, k, x, y):
        self.batch_multiple = k
        super().__init__(strategy, sizes, k, x, y)

    def _build(self):
        model = with_micro_batches(self._model(), self.k)
        model.compile(_sgd(), "mse", jit_compile=False)
        return model


class KerasBuiltinFit(FitRunner):
    key, label = "keras_builtin_fit", "Keras SGD(gradient_accumulation_steps=k)"

    def _build(self):
        model = self._model()
        model.compile(_sgd(gradient_accumulation_steps=self.k), "mse", jit_compile=False)
        return model

    def state_variables(self):
        return list(self.model.optimizer._accumulated_gradients)


class MaskTrickFit(FitRunner):
    key, label = "mask_trick_fit", "0/1 mask trick"

    def _build(self):
        model = self._model()
        optimizer = _sgd()
        model.compile(optimizer, "mse", jit_compile=False)
        optimizer.build(model.trainable_variables)
        self.patch = patch_with_mask(optimizer, self.k, model.trainable_variables)
        return model

    def state_variables(self):
        return list(self.patch.accu_gradients) + [self.patch._current_step]


def pypi_package_status() -> tuple[str | None, CapturedError | None]:
    """(installed version or None, the import error or None) of `gradient-accumulator`."""
    try:
        version = importlib.metadata.version(PYPI_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("gradient_accumulator")
    except Exception as err:  # noqa: BLE001 - recorded, any import failure
        return version, CapturedError.of(err)
    return version, None


def pypi_optimizer_error() -> CapturedError | None:
    """What constructing the package's `GradientAccumulateOptimizer` raises, if anything.

    gradient-accumulator 0.4.2 subclasses `tf.keras.optimizers.legacy.Optimizer`, which
    Keras 3 replaces by a stub that raises ImportError when instantiated.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from gradient_accumulator import GradientAccumulateOptimizer

            GradientAccumulateOptimizer(_sgd(), accum_steps=2)
    except Exception as err:  # noqa: BLE001 - recorded
        return CapturedError.of(err)
    return None


class PypiGradientAccumulatorFit(FitRunner):
    key, label = "pypi_gradient_accumulator_fit", "PyPI gradient-accumulator GradientAccumulateModel"

    def _build(self):
        from gradient_accumulator import GradientAccumulateModel

        plain = self._model()
        model = GradientAccumulateModel(accum_steps=self.k, inputs=plain.inputs,
                                        outputs=plain.outputs)
        model.compile(_sgd(), "mse", jit_compile=False)
        return model

    def state_variables(self):
        return list(self.model.gradient_accumulation) + [self.model.accum_step_counter]


# --- custom loops ---------------------------------------------------------------------


class PlainCustom(Runner):
    key, label, role, path = "plain_custom", "plain micro-batch step", "baseline", "custom loop"

    def __init__(self, strategy, sizes, k, x, y):
        super().__init__(strategy, sizes, k, x, y)
        micro = sizes.micro_batch
        with strategy.scope():
            self.model = self._model()
            self.optimizer = self._optimizer()
            self.optimizer.build(self.model.trainable_variables)
        replica_step = make_replica_step(micro)
        dataset = tf.data.Dataset.from_tensor_slices((x[:k * micro], y[:k * micro])).batch(micro)
        # One update's k micro-batches, distributed once: no input pipeline in the timing.
        self.micro_batches = list(strategy.experimental_distribute_dataset(dataset))
        model, optimizer = self.model, self.optimizer

        @tf.function
        def step(batch):
            return strategy.run(replica_step, args=(model, optimizer, *batch))

        self.step = step
        self.calls = 0
        self.run(1)

    def _model(self):
        return mlp(self.sizes.features, self.sizes.hidden, self.sizes.layers)

    def _optimizer(self):
        return _sgd()

    def _run(self, updates):
        _sync()
        start = time.perf_counter()
        for _ in range(updates):
            for batch in self.micro_batches:
                self.step(batch)
        _sync()
        seconds = time.perf_counter() - start
        self.calls += updates * len(self.micro_batches)
        return seconds

    def placement(self):
        with self.strategy.scope():
            return {"step": all_reduce_placement(self.step, self.micro_batches[0],
                                                 replicas=self.replicas)}

    def executions(self):
        return {"step": (self.calls, 0)}


class FloorCustom(PlainCustom):
    key, label, role = "floor_custom", "plain step, model with 1 hidden unit", "floor"

    def _model(self):
        return mlp(self.sizes.features, 1, 1)


class AccumulatingOptimizerCustom(PlainCustom):
    key, label, role, ours = ("accumulating_optimizer_custom", "AccumulatingOptimizer",
                              "approach", True)

    def _optimizer(self):
        return AccumulatingOptimizer(_sgd(), accumulation_steps=self.k)

    def executions(self):
        return {"step": (self.calls, int(self.optimizer.iterations.numpy()))}

    def state_variables(self):
        return self.optimizer.accumulators + [self.optimizer.total_micro_steps]


class GradientAccumulatorCustom(Runner):
    key, label, path, ours = ("gradient_accumulator_custom", "GradientAccumulator",
                              "custom loop", True)

    def __init__(self, strategy, sizes, k, x, y):
        super().__init__(strategy, sizes, k, x, y)
        rows = k * sizes.micro_batch
        self.trainer = AccumulatedTrainer(
            strategy, _sgd, x[:rows], y[:rows], k,
            model_factory=lambda: mlp(sizes.features, sizes.hidden, sizes.layers))
        self.accumulate_calls = 0
        self.run(1)

    def _run(self, updates):
        trainer = self.trainer
        _sync()
        start = time.perf_counter()
        for _ in range(updates):
            # AccumulatedTrainer.update() without its float() of each reported loss: the
            # plain loop does not read its loss either.
            for batch in trainer.micro_batches:
                trainer.accumulate_function(batch)
            trainer.apply_step()
        _sync()
        seconds = time.perf_counter() - start
        self.accumulate_calls += updates * len(trainer.micro_batches)
        return seconds

    def placement(self):
        trainer = self.trainer
        with self.strategy.scope():
            return {
                "accumulate": all_reduce_placement(trainer.accumulate_function,
                                                   trainer.micro_batches[0],
                                                   replicas=self.replicas),
                "apply": all_reduce_placement(trainer.apply_step.function,
                                              replicas=self.replicas),
            }

    def executions(self):
        applies = int(self.trainer.optimizer.iterations.numpy())
        return {"accumulate": (self.accumulate_calls, 0), "apply": (applies, 0)}

    def state_variables(self):
        accumulator = self.trainer.accumulator
        return list(accumulator.accumulated) + [accumulator.micro_step_counter]


# --- which runners, in which group ----------------------------------------------------

BASELINES = {"fit": PlainFit, "custom loop": PlainCustom}
OURS = (AccumulatingOptimizerFit, MicroBatchingFit, GradientAccumulatorCustom,
        AccumulatingOptimizerCustom)
OTHERS = (KerasBuiltinFit, MaskTrickFit, PypiGradientAccumulatorFit)
REFERENCES = (PlainBigFit, FloorFit, FloorCustom)
MAIN_ORDER = (PlainFit, PlainBigFit, AccumulatingOptimizerFit, MicroBatchingFit,
              KerasBuiltinFit, MaskTrickFit, PypiGradientAccumulatorFit,
              PlainCustom, GradientAccumulatorCustom, AccumulatingOptimizerCustom,
              FloorFit, FloorCustom)


def build(runner_class, strategy, sizes, k, x, y):
    """The runner, traced and run once; or a `Failed` record with what went wrong."""
    failed = Failed(runner_class.key, runner_class.label, runner_class.path,
                    runner_class.role, runner_class.ours)
    if runner_class is KerasBuiltinFit and k < 2:
        failed.reason = "Keras requires gradient_accumulation_steps >= 2."
        return failed
    if runner_class is PypiGradientAccumulatorFit:
        version, import_error = pypi_package_status()
        if version is None:
            failed.reason = (f"{PYPI_PACKAGE} is not installed (pip install -e '.[bench]'; "
                             "see the Performance page for what pip resolves).")
            return failed
        if import_error is not None:
            failed.error = import_error
            return failed
    try:
        return runner_class(strategy, sizes, k, x, y)
    except Exception as err:  # noqa: BLE001 - the record says what it was
        failed.error = CapturedError.of(err)
        return failed
