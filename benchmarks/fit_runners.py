"""The runners that train through `model.fit`'s step, and the PyPI package's status.

Every model is built, compiled (`jit_compile=False`, so CPU and GPU runs compile the
same way) and traced before it is timed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings

import keras
import tensorflow as tf

from benchmarks.runners import Runner, accumulating_optimizer_state, sgd, timed
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.train_step import with_micro_batches
from distgrad_course.lab.graph import fit_step_placement
from distgrad_course.pitfalls import CapturedError
from distgrad_course.pitfalls.mask_trick import patch_with_mask

PYPI_PACKAGE = "gradient-accumulator"


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
    whole_batch = False  # fit's batch: one micro-batch, or all k of an update

    def __init__(self, strategy, sizes, k, x, y):
        super().__init__(strategy, sizes, k, x, y)
        self.batch_multiple = k if self.whole_batch else 1
        self.steps = 0
        with strategy.scope():
            self.model = self._build()
        self.batch_size = self.batch_multiple * sizes.micro_batch
        rows = k * sizes.micro_batch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # A batched dataset, not arrays: `MultiWorkerFit` (benchmarks.worker_bench)
            # takes no arrays on several workers.
            self.model.fit(tf.data.Dataset.from_tensor_slices((x[:rows], y[:rows])).batch(
                self.batch_size, drop_remainder=True), epochs=1, shuffle=False, verbose=0)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
            self.batch_size, drop_remainder=True)
        # A finite list, not a live iterator: a distributed iterator kept alive (and
        # profiled) takes seconds to tear down.
        self.batches = list(strategy.experimental_distribute_dataset(dataset))
        self.run(1)  # traces the step for these (static) shapes

    def _build(self) -> keras.Model:
        """The compiled model (called under the strategy scope)."""
        model = self._model()
        model.compile(self._optimizer(model), "mse", jit_compile=False)
        return model

    def _optimizer(self, model):
        return sgd()

    def _run(self, updates):
        steps = updates * self.k // self.batch_multiple
        train_function, batches = self.model.train_function, self.batches

        def calls():
            for step in range(steps):
                # A Python iterator: train_function then calls one_step_on_data(batch).
                train_function(iter((batches[step % len(batches)],)))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seconds = timed(calls)
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
    """The plain step does not depend on k: one update per micro-batch; `k` only
    groups them (k micro-batches = one accumulated update)."""

    key, label, role = "plain_fit", "plain micro-batch step", "baseline"


class PlainBigFit(FitRunner):
    key, label, role = "plain_big_fit", "plain step on the whole batch B", "reference"
    whole_batch = True


class FloorFit(FitRunner):
    key, label, role = "floor_fit", "plain step, model with 1 hidden unit", "floor"
    hidden_units = 1


class AccumulatingOptimizerFit(FitRunner):
    key, label, ours = "accumulating_optimizer_fit", "AccumulatingOptimizer", True

    def _optimizer(self, model):
        return AccumulatingOptimizer(sgd(), accumulation_steps=self.k)

    def executions(self):
        return {"step": (self.steps, int(self.model.optimizer.iterations.numpy()))}

    def state_variables(self):
        return accumulating_optimizer_state(self.model.optimizer)


class MicroBatchingFit(FitRunner):
    key, label, ours = "micro_batching_fit", "MicroBatching train_step", True
    whole_batch = True

    def _model(self):
        return with_micro_batches(super()._model(), self.k)


class KerasBuiltinFit(FitRunner):
    key, label = "keras_builtin_fit", "Keras SGD(gradient_accumulation_steps=k)"

    def _optimizer(self, model):
        return sgd(gradient_accumulation_steps=self.k)

    def state_variables(self):
        return list(self.model.optimizer._accumulated_gradients)


class MaskTrickFit(FitRunner):
    key, label = "mask_trick_fit", "0/1 mask trick"

    def _build(self):
        model = super()._build()
        model.optimizer.build(model.trainable_variables)
        self.patch = patch_with_mask(model.optimizer, self.k, model.trainable_variables)
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
    except Exception as err:  # recorded, any import failure
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

            GradientAccumulateOptimizer(sgd(), accum_steps=2)
    except Exception as err:  # recorded
        return CapturedError.of(err)
    return None


class PypiGradientAccumulatorFit(FitRunner):
    key = "pypi_gradient_accumulator_fit"
    label = "PyPI gradient-accumulator GradientAccumulateModel"

    def _model(self):
        from gradient_accumulator import GradientAccumulateModel

        plain = super()._model()
        return GradientAccumulateModel(accum_steps=self.k, inputs=plain.inputs,
                                       outputs=plain.outputs)

    def state_variables(self):
        return list(self.model.gradient_accumulation) + [self.model.accum_step_counter]
