"""In-step micro-batching for `model.fit`: k micro-batches, one update, one all-reduce.

`MicroBatching` is a mixin for `keras.Model` whose `train_step` splits each
per-replica batch into `micro_batches` equal slices, runs forward + backward on one
slice at a time inside a `tf.while_loop`, sums the gradients as loop variables, and
calls `optimizer.apply_gradients` once, after the loop. One fit step is still one
optimizer update, so callbacks, metrics, the progress bar and learning-rate schedules
see exactly what they see without micro-batching; only the activation memory of the
backward pass shrinks (to one micro-batch's worth).

    model = MicroBatchingModel(inputs, outputs, micro_batches=4)   # functional
    model = with_micro_batches(existing_model, 4)                 # same layers, shared weights
    class MyModel(MicroBatching, keras.Model): ...                # subclassed models

How it matches Keras' own `train_step` (`keras/src/backend/tensorflow/trainer.py`,
`TensorFlowTrainer.train_step`), line by line:

* **Loss scaling for distribution.** `compute_loss` already returns the *mean* over
  the slice it is given, divided by the number of replicas R
  (`keras/src/losses/loss.py`: `reduce_values` -> `scale_loss_for_distribution`;
  regularization losses go through `Trainer._aggregate_additional_loss`, which the TF
  trainer also scales by 1/R). Each micro-batch's loss is divided by k once more, so
  the sum over k equal slices is the mean over the replica's batch / R, and the
  optimizer's SUM all-reduce across replicas turns that into the global mean
  gradient. Regularization terms, added once per slice, are counted k * (1/k) = once.
* **Mixed precision.** Each slice's loss goes through `optimizer.scale_loss` (the
  dynamic loss scale of a `LossScaleOptimizer`, identity otherwise) before
  `tape.gradient`; the summed *scaled* gradients go to `apply_gradients` once, so the
  `LossScaleOptimizer` checks finiteness, unscales and updates once per fit step.
  Accumulators have the variable dtype (float32 under `mixed_float16`). Keras 3's
  `LossScaleOptimizer` decides finiteness on replica 0's local gradients under
  `MirroredStrategy` (lesson 04); `distgrad.pitfalls.lso_first_replica_finite.
  AllReplicasFiniteLossScaleOptimizer` fixes that and works here unchanged.
* **Metrics.** The loss tracker gets each slice's loss (times R, like
  `unscale_loss_for_distribution`) weighted by the slice size, and `compute_metrics`
  is called on every slice: a `Mean` over k equal slices equals the `Mean` over the
  batch, so `fit`'s history equals plain `fit`'s. Logs come from
  `get_metrics_result()` after the update, as in Keras. The loss tracker is
  `self._loss_tracker`, the one private attribute used here: the same one Keras'
  own `train_step` updates (the history tests fail if Keras renames it).
* **One all-reduce.** The loop body holds no `apply_gradients`, hence no
  `merge_call` and no collective; there is no `tf.cond` around the apply either.

Why these shapes:

* Keras traces `train_step` under `tf.autograph.experimental.do_not_convert`
  (`TensorFlowTrainer._make_function`): a Python `for i in tf.range(k)` is *not*
  turned into a loop there, so the loop is an explicit `tf.while_loop`.
* `parallel_iterations=1`: iteration i+1's forward pass does not depend on
  iteration i's gradients, so with the `tf.while_loop` default (10, "the number of
  iterations allowed to run in parallel") TensorFlow may run several
  micro-batches at once and keep their activations alive together, which is the
  memory this class exists to save.
* Gradients are loop variables that the body *returns*; `g += _g` inside the body
  would only rebind a Python name (see `distgrad.pitfalls.compound_assignment`).

Contract and limits:

* The per-replica batch must be divisible by `micro_batches` (global batch divisible
  by `micro_batches * replicas`), including the last batch of an epoch: otherwise
  `ValueError` at trace time (static shapes) or `tf.errors.InvalidArgumentError` at
  run time, both saying how to fix it (`drop_remainder=True`, or a dataset size that
  is a multiple of the batch size). Under `jit_compile=True` (Keras' default on a GPU
  without a strategy) the run-time check would be compiled out by XLA, so a step
  traced for an unknown batch size raises `ValueError` at trace time instead.
* Exact equivalence needs Keras' default loss reduction `"sum_over_batch_size"`
  (each slice divides by its own size). `"mean_with_sample_weight"` divides each
  slice by its own sum of weights, which is not the batch's.
* Layers whose forward pass depends on the batch (BatchNorm in training mode) see
  micro-batch statistics and update their moving averages k times per step; that is
  inherent to micro-batching, not something this class can undo.
* Sparse (`IndexedSlices`) gradients are densified into the accumulators.
"""

from __future__ import annotations

import dataclasses
import warnings

import keras
import tensorflow as tf

from distgrad.collectives import ALL_REDUCE_OP_TYPES, graph_op_types


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


def check_micro_batches(global_batch_size: int, micro_batches: int, replicas: int = 1) -> int:
    """The micro-batch size (per replica) for a global batch split over replicas and slices.

    Pure function: `global_batch_size / replicas / micro_batches`.

    Raises:
        ValueError: an argument below 1, or a global batch that is not a multiple of
            `micro_batches * replicas`; the message names batch sizes that work.
    """
    _check_count("global_batch_size", global_batch_size)
    _check_count("micro_batches", micro_batches)
    _check_count("replicas", replicas)
    unit = micro_batches * replicas
    if global_batch_size % unit:
        below, above = global_batch_size // unit * unit, (global_batch_size // unit + 1) * unit
        suggestion = f"{below} or {above}" if below else f"{above}"
        raise ValueError(
            f"global batch of {global_batch_size} examples cannot be split into "
            f"{replicas} replica(s) x micro_batches={micro_batches} equal micro-batches. "
            f"Use a batch_size that is a multiple of micro_batches x replicas = {unit} "
            f"(e.g. {suggestion}), and drop a smaller last batch "
            "(tf.data: .batch(batch_size, drop_remainder=True))."
        )
    return global_batch_size // unit


def _ragged_message(micro_batches: int, replicas: int) -> str:
    unit = micro_batches * replicas
    return (
        f"MicroBatching: the per-replica batch is not divisible by micro_batches="
        f"{micro_batches} ({replicas} replica(s)). Every batch, including the last one of "
        f"an epoch, must hold a multiple of micro_batches x replicas = {unit} examples: "
        "batch a tf.data.Dataset with .batch(batch_size, drop_remainder=True), or make the "
        "number of examples a multiple of batch_size, and use a batch_size that is a "
        f"multiple of {unit}."
    )


def _xla_dynamic_batch_message(micro_batches: int, replicas: int) -> str:
    return (
        "MicroBatching with jit_compile=True needs a static batch dimension: Keras traced "
        "the step for a batch of unknown size (it retraces with a generalized shape, "
        "typically for a smaller last batch), and XLA compiles the run-time divisibility "
        "check out, so a ragged batch would be silently truncated. Batch a tf.data.Dataset "
        "with .batch(batch_size, drop_remainder=True) or make the number of examples a "
        f"multiple of batch_size (a multiple of micro_batches x replicas = "
        f"{micro_batches * replicas}), or compile with jit_compile=False."
    )


def _leading_dimension(structure):
    """(static size or None, dynamic size tensor) of the first non-None leaf."""
    leaf = next(t for t in tf.nest.flatten(structure) if t is not None)
    return leaf.shape[0], tf.shape(leaf)[0]


def _slice(structure, start, size):
    return tf.nest.map_structure(
        lambda t: None if t is None else t[start:start + size], structure)


class MicroBatching:
    """Mixin for `keras.Model`: `train_step` runs `micro_batches` slices, applies once.

    Put it *before* `keras.Model` in the bases: `class M(MicroBatching, keras.Model)`.
    `micro_batches` (constructor keyword or attribute, default 1) can be changed
    between `fit` calls; changing it drops the traced train function. `micro_batches=1`
    computes what Keras' own `train_step` computes.

    Raises (from `fit`): `ValueError` / `tf.errors.InvalidArgumentError` for a batch
    that does not split into equal micro-batches (see `check_micro_batches`).
    """

    def __init__(self, *args, micro_batches: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batches = micro_batches

    @property
    def micro_batches(self) -> int:
        return self._micro_batches

    @micro_batches.setter
    def micro_batches(self, value: int) -> None:
        _check_count("micro_batches", value)
        self._micro_batches = value
        # A traced train function has k baked in as a constant: retrace.
        self.train_function = None

    def train_step(self, data):
        k = self.micro_batches
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        static_batch, batch = _leading_dimension(x)
        if static_batch is not None:
            micro = check_micro_batches(static_batch * replicas, k, replicas)
        elif self.jit_compile:
            # XLA compiles tf.debugging assertions out (tf2xla's Assert kernel is a
            # no-op): a ragged batch would be silently truncated to k * (n // k).
            raise ValueError(_xla_dynamic_batch_message(k, replicas))
        else:
            with tf.control_dependencies([tf.debugging.assert_equal(
                    tf.math.floormod(batch, k), 0, message=_ragged_message(k, replicas))]):
                micro = batch // k

        trainable = self.trainable_variables
        if not trainable:
            warnings.warn("The model does not have any trainable weights.")
        unconnected = set()  # positions of variables the loss does not depend on

        def body(i, accumulated):
            start = i * micro
            xs, ys, ws = _slice((x, y, sample_weight), start, micro)
            with tf.GradientTape() as tape:
                y_pred = self(xs, training=True)
                loss = self.compute_loss(x=xs, y=ys, y_pred=y_pred, sample_weight=ws,
                                         training=True)
                # Keras' train_step: the tracker records the loss before the 1/R
                # distribution scaling (unscale_loss_for_distribution), weighted by
                # the number of examples; here once per micro-batch.
                self._loss_tracker.update_state(
                    loss * tf.cast(replicas, loss.dtype),
                    sample_weight=tf.shape(next(t for t in tf.nest.flatten(xs)
                                                if t is not None))[0])
                scaled = self.optimizer.scale_loss(loss / tf.cast(k, loss.dtype))
            gradients = tape.gradient(scaled, trainable)
            self.compute_metrics(xs, ys, y_pred, sample_weight=ws)
            summed = []
            for position, (acc, grad) in enumerate(zip(accumulated, gradients)):
                if grad is None:
                    unconnected.add(position)
                    summed.append(acc)
                else:
                    # New tensors, returned as loop variables: `acc += grad` would
                    # rebind a local name and leave `accumulated` as it was.
                    summed.append(acc + tf.convert_to_tensor(grad))
            return i + 1, summed

        accumulators = [tf.zeros(v.shape, dtype=v.dtype) for v in trainable]
        _, summed = tf.while_loop(
            lambda i, _: i < k, body, [tf.constant(0), accumulators],
            # One micro-batch at a time: its activations are freed before the next.
            parallel_iterations=1,
            name="micro_batches",
        )
        if trainable:
            gradients = [None if p in unconnected else g for p, g in enumerate(summed)]
            # The only sync point of the step: the optimizer's SUM all-reduce.
            self.optimizer.apply_gradients(zip(gradients, trainable))
        return self.get_metrics_result()


class MicroBatchingModel(MicroBatching, keras.Model):
    """`keras.Model` with in-step micro-batching; accepts functional arguments.

    `MicroBatchingModel(inputs, outputs, micro_batches=4)` builds a functional model
    (Keras injects `Functional` for subclasses called with inputs/outputs).
    """


def with_micro_batches(model: keras.Model, micro_batches: int) -> MicroBatchingModel:
    """A `MicroBatchingModel` over the layers of a built functional/Sequential `model`.

    The new model shares `model`'s layers and weights (same order of
    `trainable_variables`). Build it under the strategy scope the weights were
    created in. Subclassed models have no symbolic inputs: use the mixin instead.

    Raises ValueError if `model` has no symbolic inputs/outputs.
    """
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs:
        raise ValueError(
            f"{type(model).__name__} has no symbolic inputs/outputs (a subclassed or "
            "unbuilt model). Build it with keras.Input, or subclass "
            "`class MyModel(MicroBatching, keras.Model)`."
        )
    return MicroBatchingModel(inputs, outputs, micro_batches=micro_batches)


# --- counting the all-reduces of the step fit runs -----------------------------------


@dataclasses.dataclass(frozen=True)
class StepCollectives:
    """All-reduces in one traced fit step.

    `all_reduces`: all-reduce ops / replicas (times the step syncs). `in_while_bodies`:
    all-reduce ops / replicas found inside `tf.while_loop` bodies (anything there runs
    once per iteration, i.e. k times per step). `while_loops`: While ops / replicas.
    """

    all_reduces: int
    in_while_bodies: int
    while_loops: int
    replicas: int


def _reachable_functions(library: dict, roots) -> set:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in library:
            continue
        seen.add(name)
        for node in library[name].node_def:
            for attr in node.attr.values():
                if attr.HasField("func"):
                    todo.append(attr.func.name)
                todo.extend(f.name for f in attr.list.func)
            if node.op in library:  # a function called as an op
                todo.append(node.op)
    return seen


def step_collectives(graph_def: tf.compat.v1.GraphDef, replicas: int) -> StepCollectives:
    """Count all-reduces of a traced step, and those inside `tf.while_loop` bodies.

    Pure function of a GraphDef (use `fit_step_graph(model)` for fit's step).
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    nodes = list(graph_def.node) + [n for f in library.values() for n in f.node_def]
    bodies = [n.attr["body"].func.name for n in nodes if n.op in ("While", "StatelessWhile")]
    in_bodies = 0
    for name in _reachable_functions(library, bodies):
        in_bodies += sum(n.op in ALL_REDUCE_OP_TYPES for n in library[name].node_def)
    total = sum(n for t, n in graph_op_types(graph_def).items() if t in ALL_REDUCE_OP_TYPES)
    for count, what in ((total, "all-reduce ops"), (in_bodies, "all-reduce ops in loops"),
                        (len(bodies), "while loops")):
        if count % replicas:
            raise ValueError(f"{count} {what} is not a multiple of {replicas} replicas.")
    return StepCollectives(total // replicas, in_bodies // replicas, len(bodies) // replicas,
                           replicas)


def fit_step_graph(model: keras.Model, x, y, batch_size: int) -> tf.compat.v1.GraphDef:
    """The graph of the step `model.fit(x, y, batch_size=batch_size)` runs.

    Builds `model.train_function` the way `fit` does (`make_train_function`) and
    traces the `tf.function` inside it on a distributed iterator over `(x, y)`: the
    same function fit calls each step, including Keras' `strategy.run` and its
    reduction of the logs. Nothing runs, no weight changes. The model must be
    compiled and built (e.g. after one `fit` call or `model.build`).

    Raises RuntimeError if the installed Keras no longer wraps a `tf.function` there.
    """
    strategy = model.distribute_strategy
    if model.steps_per_execution != 1:
        raise ValueError("fit_step_graph traces one step: compile with steps_per_execution=1.")
    model.make_train_function(force=True)
    cells = getattr(model.train_function, "__closure__", None) or ()
    traced = [c.cell_contents for c in cells
              if hasattr(c.cell_contents, "get_concrete_function")]
    if len(traced) != 1:
        raise RuntimeError(
            "model.train_function no longer wraps exactly one tf.function "
            "(keras/src/backend/tensorflow/trainer.py changed): update fit_step_graph.")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    concrete = traced[0].get_concrete_function(iterator)
    return concrete.graph.as_graph_def()
