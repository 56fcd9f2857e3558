"""`AccumulatingOptimizer` for tf-keras (Keras 2): gradient accumulation in `model.fit`.

    # TF_USE_LEGACY_KERAS=1 was set before TensorFlow was imported
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=AccumulatingOptimizer(tf.keras.optimizers.Adam(1e-3),
                                                      accumulation_steps=4), loss="mse")

Under `mixed_float16`, `compile` wraps it in tf-keras' `LossScaleOptimizer`; wrapping by
hand, the order is `LossScaleOptimizer(AccumulatingOptimizer(inner, k))`, never the other.

It imports only TensorFlow and the standard library: copy this one file into a tf-keras
project, under any name but `tf_keras.py` (which would shadow the tf-keras package). The
Keras 3 class is `distgrad/optimizer.py`; a Keras 3 process cannot import this one.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

# The public names (the API page documents them); the other functions serve them.
__all__ = ["AccumulatingOptimizer"]

# Where tf.keras.Model lives in Keras 2: tf-keras (tested: 2.15-2.21), or the `keras` 2.x of
# TensorFlow <= 2.15 (tested: TensorFlow 2.15.1's Keras 2.15.0, by `make matrix TF=2.15`).
KERAS_2_PACKAGES = ("tf_keras.", "keras.src.engine.", "keras.engine.")
NON_FINITE_POLICIES = ("raise", "skip")


def tf_keras():
    """`tf.keras` if it is Keras 2 (tf-keras, or TensorFlow 2.15's Keras), else ImportError."""
    try:
        keras, model_module = tf.keras, tf.keras.Model.__module__
    except (ImportError, AttributeError) as err:  # TF_USE_LEGACY_KERAS=1 without tf-keras
        raise ImportError(f"tf.keras cannot be imported ({err}): `pip install tf-keras` (the "
                          "same minor version as tensorflow).") from None
    if not model_module.startswith(KERAS_2_PACKAGES):
        raise ImportError(
            f"This AccumulatingOptimizer is for tf-keras (Keras 2), but tf.keras is Keras 3 "
            f"here ({model_module}). Set the environment variable TF_USE_LEGACY_KERAS=1 "
            "before TensorFlow is imported (and `pip install tf-keras`), or, for Keras 3, "
            "use distgrad.AccumulatingOptimizer (distgrad/optimizer.py).")
    return keras


NON_FINITE_MESSAGE = ("AccumulatingOptimizer: NaN/Inf gradients on some replica in the cycle "
                      "of update")
NON_FINITE_HINT = ("(total_micro_steps); nothing applied. non_finite='skip' would drop and "
                   "count it.")


keras = tf_keras()
OptimizerV2 = keras.optimizers.legacy.Optimizer  # the era's optimizers (tf.keras before 2.11)


class _Untracked:
    """Holds the model's variables without making them checkpoint dependencies."""

    def __init__(self, values):
        self.values = list(values)


@keras.utils.register_keras_serializable(package="distgrad")
class AccumulatingOptimizer(keras.optimizers.Optimizer):
    """Accumulate `accumulation_steps` micro-batch gradients, then update `inner_optimizer`.

    tf-keras (Keras 2). Every k-th call of `apply_gradients` updates the inner optimizer with
    the *mean* of the k accumulated gradients: in `model.fit` (the stock `train_step` or
    one calling `apply_gradients`) and custom loops, under `MirroredStrategy` or without a
    strategy. `n * k` calls equal `n` steps on k-times larger batches, with one gradient
    all-reduce per update. Create the model, the inner optimizer and this wrapper under one
    scope. Design notes: docs/design.md.

    Args:
        inner_optimizer: the tf-keras optimizer that updates: `tf.keras.optimizers.*`, or
            the era's `tf.keras.optimizers.legacy.*` (OptimizerV2). Its options (clipping,
            weight decay, EMA) stay on it: tf-keras clips the all-reduced gradient.
        accumulation_steps: k, the micro-batches per update (`1` updates every call).
        non_finite: a cycle with NaN/Inf gradients on any replica (float32, no loss
            scaling). "raise" (default): the call ending it fails with
            `tf.errors.InvalidArgumentError` naming the update, nothing applied,
            accumulators kept. "skip": no update, accumulators zeroed, counted in
            `skipped_updates`.
        name: optimizer name.

    Mixed precision: `LossScaleOptimizer(AccumulatingOptimizer(inner, k))`, the wrapper
    `compile` adds under `mixed_float16`. It unscales and checks each micro-batch before
    it is accumulated; an overflow on any replica skips that micro-batch on every replica
    (`aggregate_gradients`) and halves the scale once. The cycle waits for k finite ones.

    State (`tf.train.Checkpoint` and `model.save`: see "What it saves and restores" below):
    `accumulators`, `micro_steps` (`0 <= n < k`), `total_micro_steps`, `skipped_updates`;
    `iterations`: updates plus the micro-batches a wrapping `LossScaleOptimizer` skipped
    (`skipped_micro_batches`); `inner_optimizer.iterations` counts updates only. A `fit`
    that skipped updates or micro-batches ends with a `UserWarning` that counts them.
    `import distgrad` registers this class with tf-keras.

    Example:

    ```python
    import os
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported
    import tensorflow as tf
    from distgrad.tf_keras import AccumulatingOptimizer

    with strategy.scope():
        model = make_model()  # a tf.keras model
        model.compile(optimizer=AccumulatingOptimizer(tf.keras.optimizers.Adam(1e-3), 4),
                      loss="mse")
    model.fit(dataset.batch(32), epochs=3)  # one update per 4 batches
    ```

    Raises:
        ValueError: bad `accumulation_steps` / `non_finite`; clipping or other options
            given to the wrapper; `skip_gradients_aggregation=True` (it all-reduces once
            per update itself); 2+ replicas without merge_call (an XLA-compiled step);
            (`load_model`) a `mixed_float16` save loaded without a `LossScaleOptimizer`,
            or another optimizer's state.
        TypeError: `inner_optimizer` is not a tf-keras optimizer, or is a
            `LossScaleOptimizer` (wrap the other way round).
        RuntimeError: built under another strategy than the one it was created under, or
            `apply_gradients` in cross-replica context.
        tf.errors.InvalidArgumentError: (run time) a non-finite cycle under "raise".
        ImportError: (on import) tf.keras is Keras 3: set `TF_USE_LEGACY_KERAS=1` first.
    """

    def __init__(self, inner_optimizer, accumulation_steps, non_finite="raise",
                 name="AccumulatingOptimizer", **kwargs):
        check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs)
        super().__init__(name=name, jit_compile=False)
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
        self.non_finite = non_finite
        self._accumulators, self._model_variables = [], _Untracked([])
        self._skips_reported = None  # (skipped updates, micro-batches) at the last report

    def _create_iteration_variable(self):  # BaseOptimizer's, under another name: `.h5`
        # names each optimizer variable's dataset by `variable.name`, and the inner
        # optimizer's is "iteration" too.
        with tf.init_scope():
            self._iterations = tf.Variable(0, name="accumulating_iteration", dtype=tf.int64,
                                           trainable=False)
        self._variables.append(self._iterations)

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate; setting it sets the inner optimizer's."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):  # callbacks set it through the wrapper
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):  # updates (+ a wrapping LossScaleOptimizer's skips)
        return self._iterations

    @iterations.setter
    def iterations(self, variable):  # BaseOptimizer's setter; LossScaleOptimizer delegates
        self._iterations = variable

    @property
    def accumulators(self):  # the replica-local gradient sums, one per trainable variable
        return list(self._accumulators)

    def build(self, var_list):
        """Create accumulators and counters, and build the inner optimizer."""
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        strategy = tf.distribute.get_strategy()
        check_built_under(self, strategy)
        self._model_variables = _Untracked(var_list)
        # ON_READ + SUM: each replica adds to its own copy, no communication; a cross-
        # replica read (and a checkpoint) is the sum. float32: float16 sums lose gradients.
        self._accumulators = [
            tf.Variable(tf.zeros(v.shape, tf.float64 if v.dtype == tf.float64 else tf.float32),
                        trainable=False, name=f"accumulated/{v._shared_name}",
                        synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM) for v in var_list]
        self._variables.extend(self._accumulators)  # saved by `model.save` too
        self.micro_steps = self.add_variable((), tf.int64, name="micro_steps")
        self.total_micro_steps = self.add_variable((), tf.int64, name="total_micro_steps")
        self.skipped_updates = self.add_variable((), tf.int64, name="skipped_updates")
        if isinstance(self.inner_optimizer, OptimizerV2):
            self.inner_optimizer._create_all_weights(var_list)  # its slots, now, not in a trace
        else:
            self.inner_optimizer.build(var_list)
        self._built = True

    def aggregate_gradients(self, grads_and_vars):
        """What a wrapping `LossScaleOptimizer` all-reduces before its finiteness check.

        The gradients stay this replica's (the all-reduce comes once per update), but if
        any replica's are non-finite, the first gradient becomes NaN on every replica, so
        that the wrapper, which reads replica 0, skips the micro-batch everywhere.
        """
        grads_and_vars = list(grads_and_vars)
        context = tf.distribute.get_replica_context()
        present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
        if context is None or context.num_replicas_in_sync == 1 or not present:
            return grads_and_vars
        non_finite = context.all_reduce(tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(
            _all_finite([grads_and_vars[i][0] for i in present]), tf.float32))
        first, variable = grads_and_vars[present[0]]
        poison = tf.where(non_finite > 0.0, float("nan"), 0.0)
        if isinstance(first, tf.IndexedSlices):
            first = tf.IndexedSlices(first.values + tf.cast(poison, first.dtype), first.indices,
                                     first.dense_shape)
        else:
            first = first + tf.cast(poison, first.dtype)  # + 0.0: the same values
        grads_and_vars[present[0]] = (first, variable)
        return grads_and_vars

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                        **kwargs):
        """Accumulate this replica's gradients (`None` skipped); on every k-th call,
        update. Replica context (inside `strategy.run`, as `fit` does, or without a
        strategy)."""
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        wrapped = getattr(self, "_is_wrapped_by_loss_scale_optimizer", False)
        if (skip_gradients_aggregation or not kwargs.pop("experimental_aggregate_gradients",
                                                         True)) and not wrapped:
            raise ValueError("AccumulatingOptimizer all-reduces once per update itself: pass "
                             "each replica's own gradients, without skip_gradients_aggregation.")
        if not grads_and_vars:
            raise ValueError("No gradients provided for any variable.")
        if tf.distribute.in_cross_replica_context():
            raise RuntimeError("AccumulatingOptimizer.apply_gradients must be called in "
                               "replica context: inside strategy.run(step_fn, ...) (or through "
                               "model.fit), not directly under strategy.scope().")
        with tf.init_scope():
            self.build(self._model_variables.values or [v for _, v in grads_and_vars])
        if self._skips_reported is None:  # the first trace: restored counts are not news
            self._skips_reported = self._skip_counts()
        with tf.name_scope(name or self.name):
            for grad, variable in grads_and_vars:  # replica-local: no communication
                accumulator = self._accumulator_of(variable)
                accumulator.assign_add(tf.cast(tf.convert_to_tensor(grad), accumulator.dtype))
            self._end_cycle([v for _, v in grads_and_vars])
        return self._iterations

    def _accumulator_of(self, variable):
        key = self._var_key(variable)
        for model_variable, accumulator in zip(self._model_variables.values, self._accumulators):
            if self._var_key(model_variable) == key:
                return accumulator
        raise KeyError(f"AccumulatingOptimizer was built for other variables than "
                       f"{variable.name}: build it with all of model.trainable_variables.")

    def _end_cycle(self, variables):
        context = tf.distribute.get_replica_context()
        if not tf.__internal__.distribute.strategy_supports_no_merge_call():
            context.merge_call(lambda distribution: self._cross_replica_step(distribution,
                                                                             variables))
        elif context.num_replicas_in_sync == 1:  # the default strategy: no merge_call
            self._cross_replica_step(None, variables)
        else:
            raise ValueError(
                "AccumulatingOptimizer (tf-keras) needs merge_call on several replicas; this "
                "step has none (it is XLA-compiled): compile with jit_compile=False.")

    def _cross_replica_step(self, distribution, variables):
        # Once for all replicas (from merge_call: cross-replica context), so one count and
        # one decision. A cond whose branch calls merge_call (the inner update does) must
        # be built here, not in replica context (as in LossScaleOptimizer.apply_gradients);
        # call_for_each_replica starts fresh replica threads inside the branch.
        def on_replicas(fn):
            return fn() if distribution is None else distribution.extended.call_for_each_replica(fn)

        self.total_micro_steps.assign_add(1)
        self.micro_steps.assign(tf.math.floormod(self.micro_steps + 1, self.accumulation_steps))

        def finish_cycle():
            finite = on_replicas(lambda: _all_finite([self._accumulator_of(v) for v in variables]))
            if distribution is not None:  # every replica's flag is visible here
                finite = tf.reduce_all(tf.stack(distribution.experimental_local_results(finite)))

            def apply_cycle():
                on_replicas(lambda: self._apply_accumulated(variables))
                self._iterations.assign_add(1)
                return tf.constant(False)

            def drop_cycle():
                if self.non_finite == "raise" and not getattr(
                        self, "_is_wrapped_by_loss_scale_optimizer", False):
                    tf.debugging.Assert(False, [
                        NON_FINITE_MESSAGE, self.inner_optimizer.iterations + 1,
                        "ending at micro-step", self.total_micro_steps.value(), NON_FINITE_HINT])
                    return tf.constant(False)
                on_replicas(self._reset_accumulators)
                return tf.constant(True)

            return tf.cond(finite, apply_cycle, drop_cycle)

        skipped = tf.cond(tf.equal(self.micro_steps, 0), finish_cycle, lambda: tf.constant(False))
        self.skipped_updates.assign_add(tf.cast(skipped, tf.int64))

    def _apply_accumulated(self, variables):
        # Replica context: this replica's share of the mean; the inner optimizer's SUM
        # all-reduce (the cycle's only gradient communication) adds the replicas.
        grads = [tf.cast(self._accumulator_of(v).read_value() / self.accumulation_steps,
                         getattr(v, "true_dtype", v.dtype)) for v in variables]
        self.inner_optimizer.apply_gradients(zip(grads, variables))
        self._reset_accumulators()

    def _reset_accumulators(self):
        for accumulator in self._accumulators:
            accumulator.assign(tf.zeros_like(accumulator))

    @property
    def skipped_micro_batches(self):
        """Micro-batches a wrapping `LossScaleOptimizer` skipped as overflowing (it counts
        them in `iterations`; the inner optimizer counts updates only)."""
        return self._iterations - tf.cast(self.inner_optimizer.iterations, tf.int64)

    def _skip_counts(self):
        with tf.init_scope():  # eager, also while a step is being traced
            return (int(self.skipped_updates.numpy()), int(self.skipped_micro_batches.numpy()))

    def finalize_variable_values(self, var_list):
        """tf-keras calls it at the end of every `fit`: the inner optimizer's (EMA), then a
        `UserWarning` if cycles or micro-batches were skipped since the last call."""
        if hasattr(self.inner_optimizer, "finalize_variable_values"):  # not OptimizerV2
            self.inner_optimizer.finalize_variable_values(var_list)
        if not getattr(self, "_built", False):
            return
        counts, before = self._skip_counts(), self._skips_reported
        if before is not None and counts != before:
            (updates, micro_batches), (updates_before, micro_batches_before) = counts, before
            warnings.warn(
                f"AccumulatingOptimizer: skipped in this fit: {updates - updates_before} "
                f"update(s) whose cycle's gradients were NaN/Inf on some replica "
                f"(`optimizer.skipped_updates`: {updates} in all), and "
                f"{micro_batches - micro_batches_before} micro-batch(es) whose gradients "
                "overflowed, after which the LossScaleOptimizer halved its scale "
                f"(`skipped_micro_batches`: {micro_batches} in all).", stacklevel=2)
        self._skips_reported = counts

    # ---- What it saves and restores. `tf.train.Checkpoint` and `model.save` (`.keras`, or `.h5`
    # without loss scaling) save the wrapper's variables (the accumulators among them), the inner
    # optimizer's, and the dynamic loss scale of a wrapping `LossScaleOptimizer`, which `model.save`
    # alone would reset. The accumulators are replica-local SUM variables: a checkpoint holds their
    # sum over replicas and restores sum / R on every replica, so a restored cycle ends with the
    # same update. Under a `LossScaleOptimizer`, `variables` leaves them out (that wrapper restores
    # `variables` by plain assignment, which a SUM variable under a strategy cannot take from a
    # file); `save_own_variables` / `load_own_variables` keep them.
    #
    # A `mixed_float16` model is compiled with a `LossScaleOptimizer` on load only when the global
    # policy is `mixed_float16` (tf-keras wraps in `compile`): set it before `load_model`, or the
    # load raises a `ValueError` that says so. Under `mixed_float16` use `.keras` (tf-keras' `.h5`
    # loader restores an optimizer's state with `set_weights`, which its `LossScaleOptimizerV3`
    # lacks).

    @property
    def variables(self):  # the wrapper's, the inner optimizer's, the loss scale's
        if not getattr(self, "_is_wrapped_by_loss_scale_optimizer", False):
            return _CallableList(self._state())
        accumulators = {id(a) for a in self._accumulators}
        return _CallableList(v for v in self._state() if id(v) not in accumulators)

    def _state(self):  # everything `model.save` keeps, in this order
        # A wrapping LossScaleOptimizer tracks its dynamic loss scale through this
        # optimizer (DelegatingTrackableMixin), under the name "loss_scale".
        loss_scale = self._lookup_dependency("loss_scale")
        return (self._variables + _listed(self.inner_optimizer.variables)
                + ([] if loss_scale is None else [loss_scale.current_loss_scale,
                                                  loss_scale.counter]))

    def save_own_variables(self, store):  # all of `_state()`, the accumulators too
        for i, variable in enumerate(self._state()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):  # `model.save` files hold h5py datasets, and
        # assigning one to a SUM variable across replicas divides it first: read arrays.
        values = [store[str(i)][()] for i in range(len(store.keys()))]
        core = len(self._variables) + len(_listed(self.inner_optimizer.variables))
        # A LossScaleOptimizer's file holds its `variables` (no accumulators; see above)
        # with the loss scale; the inner file holds everything.
        saved_under_loss_scaling = len(values) != core and len(values) in (
            core + 2, core + 2 - len(self._accumulators))
        if saved_under_loss_scaling and len(self._state()) == core:
            raise ValueError(
                "AccumulatingOptimizer: this file was saved under a LossScaleOptimizer "
                "(mixed_float16), but the loaded model compiled it without one: tf-keras "
                "wraps the optimizer in compile only when the global dtype policy is "
                "mixed_float16. Call tf.keras.mixed_precision.set_global_policy("
                "'mixed_float16') before load_model (or load_model(..., compile=False) to "
                "leave the optimizer state behind).")
        if not core <= len(values) <= core + 2:  # + the loss scale, in the file or here
            raise ValueError(
                f"AccumulatingOptimizer: cannot restore the optimizer state: {core} "
                f"variables here (without a loss scale), {len(values)} in the file. Load it "
                "into the model and optimizer it was saved from.")
        for variable, value in zip(self._state(), values):
            variable.assign(value)

    def set_weights(self, weights):  # over `variables` (.h5 loads restore through it)
        variables = self.variables
        if not getattr(self, "_built", False) or len(weights) != len(variables):
            raise ValueError(f"AccumulatingOptimizer.set_weights: {len(weights)} weights for "
                             f"{len(variables)} variables (built: "
                             f"{getattr(self, '_built', False)}).")
        for variable, weight in zip(variables, weights):  # h5py datasets: to tensors first
            variable.assign(tf.convert_to_tensor(weight))

    def get_config(self):
        return {"name": self.name, "accumulation_steps": self.accumulation_steps,
                "non_finite": self.non_finite, "is_legacy_optimizer": False,  # for deserialize
                "inner_optimizer": keras.optimizers.serialize(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config.pop("is_legacy_optimizer", None)
        inner = keras.optimizers.deserialize(config.pop("inner_optimizer"),
                                             custom_objects=custom_objects,
                                             use_legacy_optimizer=False)
        return cls(inner, **config)


def _all_finite(tensors):
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(t)))
                                   for t in tensors]))


# ---- What it refuses, each with a message naming the fix: a `tf.keras` that is not Keras 2
# (on import, above), bad arguments (at construction), and an optimizer built under another
# strategy than it was created under.

def describe(strategy) -> str:
    """A strategy as the messages name it."""
    named = strategy is not None and type(strategy).__name__ != "_DefaultDistributionStrategy"
    return (f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s)"
            if named else "no strategy")


def created_under(optimizer, strategy):
    """The strategy `optimizer` was created under (None: none, under a strategy now)."""
    owner = getattr(optimizer, "_distribution_strategy", strategy)
    if owner is None:  # an OptimizerV2 created outside every strategy scope
        return None if tf.distribute.has_strategy() else strategy
    return owner


def check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs) -> None:
    """`AccumulatingOptimizer.__init__`'s arguments."""
    keras = tf_keras()
    optimizer_v2 = keras.optimizers.legacy.Optimizer  # the era's (tf.keras before 2.11)
    if type(accumulation_steps) is not int or accumulation_steps < 1:
        raise ValueError("accumulation_steps must be an integer >= 1 (micro-batches per "
                         f"update), got {accumulation_steps!r}.")
    if non_finite not in NON_FINITE_POLICIES:
        raise ValueError(f"non_finite must be one of {NON_FINITE_POLICIES}, got {non_finite!r}.")
    if kwargs:
        raise ValueError(f"AccumulatingOptimizer does not take {sorted(kwargs)}: set them on "
                         "the inner optimizer (tf-keras clips after its all-reduce, once per "
                         "update).")
    if isinstance(inner_optimizer, keras.mixed_precision.LossScaleOptimizer):
        raise TypeError("Wrap the other way round: LossScaleOptimizer(AccumulatingOptimizer("
                        "inner, k)) (model.compile does it under mixed_float16), so that each "
                        "micro-batch is unscaled and checked before it is accumulated.")
    if not isinstance(inner_optimizer, (keras.optimizers.Optimizer, optimizer_v2)):
        kind = type(inner_optimizer)
        raise TypeError(f"AccumulatingOptimizer wraps a tf-keras optimizer instance, got "
                        f"{kind.__name__} from {kind.__module__}. Pass e.g. "
                        "tf.keras.optimizers.Adam(...) or tf.keras.optimizers.legacy.SGD(...).")


def check_built_under(optimizer, strategy) -> None:
    """In `build`: the wrapper and its inner optimizer were created under `strategy`."""
    for who, candidate in (("AccumulatingOptimizer", optimizer),
                           ("its inner optimizer", optimizer.inner_optimizer)):
        if (owner := created_under(candidate, strategy)) is not strategy:
            raise RuntimeError(
                f"{who} was created under {describe(owner)} but is built under "
                f"{describe(strategy)}. Create the model, the inner optimizer and the "
                "AccumulatingOptimizer inside the same `with strategy.scope():` block.")


class _CallableList(list):
    """A list that is also `opt.variables()`, as tf-keras' own optimizers allow."""

    def __call__(self):
        return self


def _listed(variables):
    return list(variables() if callable(variables) else variables)
