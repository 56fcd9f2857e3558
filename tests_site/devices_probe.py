"""Child target of test_docs_pages: what `distgrad_course.make_strategy` does to TensorFloat-32.

Run in a fresh process (`distgrad_course.lab.child`), so the setting read first is TensorFlow's
default, not one an earlier test left behind.
"""

from __future__ import annotations


def tf32_around_make_strategy() -> dict:
    """TF32 execution enabled before and after `make_strategy(2)`, and what
    `environment_report` prints for it."""
    import tensorflow as tf

    from distgrad_course.devices import environment_report, make_strategy

    before = tf.config.experimental.tensor_float_32_execution_enabled()
    strategy = make_strategy(2)
    return {"before": before,
            "after": tf.config.experimental.tensor_float_32_execution_enabled(),
            "reported": environment_report(strategy)["tensor_float_32"]}
