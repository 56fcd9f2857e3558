"""The tf-keras program of `tests/test_recipes.py`: the Keras 2 names of the Recipes page's
loss-scale table (`docs/recipes.md#loss-scale-keras2-keras3`), run in a
`distgrad_course.lab.tf_keras_runner.run_tf_keras` child (tf-keras, `TF_USE_LEGACY_KERAS=1`)."""


def tf_keras_loss_scale(replicas):
    """What tf-keras' `LossScaleOptimizer` does with the calls the table names, on one
    variable and no strategy (`replicas` is run_tf_keras's, unused); JSON-able."""
    del replicas
    import tensorflow as tf

    import distgrad.tf_keras

    keras = tf.keras  # tf-keras: the child runs with TF_USE_LEGACY_KERAS=1
    lso_class = keras.mixed_precision.LossScaleOptimizer
    default = lso_class(keras.optimizers.SGD(1.0))
    seen = {"module": type(default).__module__,
            "default": [default.dynamic, float(default.initial_scale),
                        default.dynamic_growth_steps, float(default.loss_scale)]}
    opt = lso_class(keras.optimizers.SGD(1.0), initial_scale=8.0, dynamic_growth_steps=2)
    var = tf.Variable(1.0)
    seen["scaled_loss"] = float(opt.get_scaled_loss(tf.constant(2.0)))
    seen["unscaled_gradients"] = [float(g) for g in opt.get_unscaled_gradients(
        [tf.constant(16.0)])]
    opt.apply_gradients([(tf.constant(0.5), var)])  # not divided by the scale: 1 - 0.5
    seen["after_apply"] = float(var.numpy())
    seen["counter_after_one"] = int(opt.dynamic_counter.numpy())
    opt.apply_gradients([(tf.constant(0.0), var)])  # 2 finite steps: the scale doubles
    seen["scale_after_growth"] = float(opt.loss_scale)
    seen["counter_after_growth"] = int(opt.dynamic_counter.numpy())
    opt.apply_gradients([(tf.constant(float("inf")), var)])  # skipped, the scale halves
    seen["after_inf"] = [float(var.numpy()), float(opt.loss_scale)]
    fixed = lso_class(keras.optimizers.SGD(1.0), dynamic=False, initial_scale=4.0)
    seen["fixed"] = [fixed.dynamic, float(fixed.loss_scale),
                     float(fixed.get_scaled_loss(tf.constant(1.0)))]
    seen["has_scale_loss"] = hasattr(opt, "scale_loss")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        seen["compiled"] = isinstance(model.optimizer, lso_class)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # The epoch's leftover micro-batches: the tf-keras class can only carry them.
    accumulating = distgrad.tf_keras.AccumulatingOptimizer
    seen["tf_keras_flush"] = [hasattr(accumulating, name) for name in ("flush", "discard")]
    seen["tf_keras_micro_batching"] = hasattr(distgrad.tf_keras, "MicroBatching")
    return seen
