"""The runners that train in a custom loop: `strategy.run` in a `tf.function`.

Each feeds one update's k micro-batches, distributed once beforehand (no input
pipeline in the timing), and is traced and run once before it is timed.
"""

from __future__ import annotations

import tensorflow as tf

from benchmarks.runners import Runner, accumulating_optimizer_state, sgd, timed
from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.accumulation import AccumulatedTrainer
from distgrad_course.lab.graph import all_reduce_placement
from distgrad_course.lab.recipes import make_replica_step


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
        self.micro_batches = list(strategy.experimental_distribute_dataset(dataset))
        model, optimizer = self.model, self.optimizer

        @tf.function
        def step(batch):
            return strategy.run(replica_step, args=(model, optimizer, *batch))

        self.step = step
        self.calls = 0
        self.run(1)

    def _optimizer(self):
        return sgd()

    def _run(self, updates):
        def calls():
            for _ in range(updates):
                for batch in self.micro_batches:
                    self.step(batch)

        seconds = timed(calls)
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
    hidden_units = 1


class AccumulatingOptimizerCustom(PlainCustom):
    key, label, role, ours = ("accumulating_optimizer_custom", "AccumulatingOptimizer",
                              "approach", True)

    def _optimizer(self):
        return AccumulatingOptimizer(sgd(), accumulation_steps=self.k)

    def executions(self):
        return {"step": (self.calls, int(self.optimizer.iterations.numpy()))}

    def state_variables(self):
        return accumulating_optimizer_state(self.optimizer)


class GradientAccumulatorCustom(Runner):
    key, label, path, ours = ("gradient_accumulator_custom", "GradientAccumulator",
                              "custom loop", True)

    def __init__(self, strategy, sizes, k, x, y):
        super().__init__(strategy, sizes, k, x, y)
        rows = k * sizes.micro_batch
        self.trainer = AccumulatedTrainer(strategy, sgd, x[:rows], y[:rows], k,
                                          model_factory=self._model)
        self.accumulate_calls = 0
        self.run(1)

    def _run(self, updates):
        trainer = self.trainer

        def calls():
            for _ in range(updates):
                # AccumulatedTrainer.update() without its float() of each reported loss:
                # the plain loop does not read its loss either.
                for batch in trainer.micro_batches:
                    trainer.accumulate_function(batch)
                trainer.apply_step()

        seconds = timed(calls)
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
