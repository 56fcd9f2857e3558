"""What `AccumulatingOptimizer` refuses before it runs, each with a message naming the fix.

Bad arguments (at construction); an optimizer built or applied under another strategy than
it was created under, or applied in cross-replica context; and steps that stock Keras
cannot run on 2+ replicas (traced in a `tf.cond` branch, as `steps_per_execution > 1`
builds them, or XLA-compiled on devices that are not all GPUs), caught at trace time.
Copied with `optimizer.py` and `non_finite.py`: it imports only TensorFlow, Keras and
`distgrad.non_finite`, or, copied into a project, `non_finite`. Design notes:
docs/design.md, "AccumulatingOptimizer".
"""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext  # XLA or not
from tensorflow.python.ops.control_flow_v2_func_graphs import CondBranchFuncGraph

try:
    from distgrad.non_finite import check_policy
except ImportError:  # copied into a project: non_finite.py beside this file
    from non_finite import check_policy

STEPS_PER_EXECUTION_MESSAGE = (
    "Compile with steps_per_execution=1 (accumulation already cuts the all-reduces per "
    "example k-fold): AccumulatingOptimizer's step, traced in a tf.cond branch as "
    "steps_per_execution > 1 builds it, cannot run on {replicas} replicas, where TensorFlow "
    "does not feed its all-reduce its key (stock Keras, plain Adam too). "
    "https://github.com/keras-team/keras/issues/19246")
JIT_COMPILE_MESSAGE = (
    "Compile with jit_compile=False (what Keras' default, \"auto\", picks under "
    "tf.distribute): AccumulatingOptimizer's XLA-compiled step cannot run on {replicas} "
    "replicas that are not all GPUs, as one XLA cluster cannot reach the other device's "
    "variables (stock Keras, plain Adam too). https://github.com/keras-team/keras/issues/19005")


def describe(strategy) -> str:
    """A strategy as the messages name it."""
    if strategy is None or type(strategy).__name__ == "_DefaultDistributionStrategy":
        return "no strategy" + ("" if strategy is None else " (the default strategy)")
    return f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica(s)"


def check_arguments(inner_optimizer, accumulation_steps, non_finite, kwargs) -> None:
    """`AccumulatingOptimizer.__init__`'s arguments."""
    if (isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int)
            or accumulation_steps < 1):
        raise ValueError("accumulation_steps must be an integer >= 1 (the micro-batches per "
                         f"update), got {accumulation_steps!r}.")
    check_policy(non_finite)
    if kwargs:
        raise ValueError(f"AccumulatingOptimizer does not take {sorted(kwargs)}: set them on the "
                         "inner optimizer (the wrapper then clips the all-reduced gradient).")
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        kind = type(inner_optimizer)
        fix = (f"keras.optimizers.get({inner_optimizer!r})" if isinstance(inner_optimizer, str)
               else "e.g. keras.optimizers.SGD / Adam / AdamW")
        raise TypeError(f"Pass {fix}: AccumulatingOptimizer wraps a Keras 3 optimizer, got "
                        f"{kind.__name__} from {kind.__module__} (not tf.compat.v1 optimizers; "
                        "tf-keras ones go in distgrad.tf_keras.AccumulatingOptimizer).")
    if steps := getattr(inner_optimizer, "gradient_accumulation_steps", None):
        raise ValueError("Create the inner optimizer without gradient_accumulation_steps (it "
                         f"has {steps}): AccumulatingOptimizer(accumulation_steps=) accumulates.")


def check_built_under(optimizer, strategy) -> None:
    """In `build`: the wrapper and its inner optimizer were created under `strategy`."""
    inner_strategy = getattr(optimizer.inner_optimizer, "_distribution_strategy", strategy)
    for who, created_under in (("AccumulatingOptimizer", optimizer._distribution_strategy),
                               ("its inner optimizer", inner_strategy)):
        if created_under is not strategy:
            raise RuntimeError(
                "Create the model, the inner optimizer and the AccumulatingOptimizer inside "
                f"the same `with strategy.scope():` block: {who} was created under "
                f"{describe(created_under)} but is built under {describe(strategy)}.")


def check_step(built_under) -> None:
    """In `apply`: replica context of the strategy it was built under, and a step that can
    run there."""
    if tf.distribute.get_strategy() is not built_under:
        raise RuntimeError(
            "Call apply_gradients inside strategy.run(...) of the strategy it was built "
            "under (model.fit does), or create a new model and optimizer inside the other "
            f"strategy's scope(): AccumulatingOptimizer was built under "
            f"{describe(built_under)} but apply_gradients is called under "
            f"{describe(tf.distribute.get_strategy())}.")
    if tf.distribute.in_cross_replica_context():
        raise ValueError("Call apply_gradients inside strategy.run(step_fn, ...) (or through "
                         "model.fit): AccumulatingOptimizer.apply_gradients must be called "
                         "in replica context, not directly under strategy.scope().")
    if message := unrunnable_step(tf.distribute.get_strategy().num_replicas_in_sync):
        raise ValueError(message)


def check_outside_run(what: str) -> None:
    """`flush` and `discard`: outside `strategy.run`, in cross-replica context."""
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        raise ValueError(f"AccumulatingOptimizer.{what}() must be called outside "
                         "strategy.run (in cross-replica context), e.g. eagerly.")


def called_from_a_cond_branch() -> bool:
    """True if the function being traced is called, directly or through its callers, from
    a `tf.cond` branch."""
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    graph = getattr(graph, "outer_graph", None)
    while graph is not None:
        if isinstance(graph, CondBranchFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def unrunnable_step(replicas: int) -> str | None:
    """The message for a step traced here that cannot run on `replicas` replicas, or None
    (stock Keras failures, caught at trace time; XLA on GPUs is left alone)."""
    if replicas < 2:
        return None
    if called_from_a_cond_branch():
        return STEPS_PER_EXECUTION_MESSAGE.format(replicas=replicas)
    if (GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
            and not tf.__internal__.distribute.strategy_supports_no_merge_call()):
        return JIT_COMPILE_MESSAGE.format(replicas=replicas)
    return None
