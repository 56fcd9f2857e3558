"""What the tf-keras `AccumulatingOptimizer` saves and restores, under a loss scale too.

`tf.train.Checkpoint` and `model.save` (`.keras`, or `.h5` without loss scaling) save the
wrapper's variables (the accumulators among them), the inner optimizer's, and the dynamic
loss scale of a wrapping `LossScaleOptimizer`, which `model.save` alone would reset. The
accumulators are replica-local SUM variables: a checkpoint holds their sum over replicas
and restores sum / R on every replica, so a restored cycle ends with the same update.
Under a `LossScaleOptimizer`, `variables` leaves them out (that wrapper restores
`variables` by plain assignment, which a SUM variable under a strategy cannot take from
a file); `save_own_variables` / `load_own_variables` keep them.

A `mixed_float16` model is compiled with a `LossScaleOptimizer` on load only when the
global policy is `mixed_float16` (tf-keras wraps in `compile`): set it before
`load_model`, or the load raises a `ValueError` that says so. Under `mixed_float16` use
`.keras` (tf-keras' `.h5` loader restores an optimizer's state with `set_weights`, which
its `LossScaleOptimizerV3` lacks).

Copied with `optimizer.py` (the tf-keras one); it imports only TensorFlow.
"""

from __future__ import annotations

import tensorflow as tf


class _CallableList(list):
    """A list that is also `opt.variables()`, as tf-keras' own optimizers allow."""

    def __call__(self):
        return self


def _listed(variables):
    return list(variables() if callable(variables) else variables)


class SavedState:
    """The mixin of the tf-keras `AccumulatingOptimizer` that defines its saved state."""

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
