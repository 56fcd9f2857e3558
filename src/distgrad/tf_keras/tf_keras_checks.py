"""What the tf-keras `AccumulatingOptimizer` refuses, each with a message naming the fix.

A `tf.keras` that is not Keras 2 (on import), bad arguments (at construction), and an
optimizer built under another strategy than it was created under. Copied with
`optimizer.py` (the tf-keras one); it imports only TensorFlow.
"""

from __future__ import annotations

import tensorflow as tf

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
