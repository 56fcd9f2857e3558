import keras
import pytest
import tensorflow as tf

from distgrad_course.lab.data import regression_data
from distgrad_course.lab.graph import CollectiveCount, count_collectives, graph_op_types
from distgrad_course.lab.recipes import make_replica_step, run_steps

SGD = lambda: keras.optimizers.SGD(0.1)  # noqa: E731


def test_apply_gradients_step_has_one_all_reduce_per_replica(strategy2):
    x, y = regression_data(16)
    run = run_steps(strategy2, SGD, x, y, make_replica_step(16))
    with strategy2.scope():
        count = count_collectives(run.step_function, run.batch)
    assert count.op_types == {"CollectiveReduceV2": 2}
    assert count.all_reduces == 1


def test_gradients_only_step_has_no_all_reduce(strategy2):
    x, y = regression_data(16)
    run = run_steps(strategy2, SGD, x, y, make_replica_step(16, apply="none"))
    count = count_collectives(run.step_function, run.batch, replicas=2)
    assert count.all_reduce_ops == 0


def test_ops_inside_cond_branches_are_counted():
    # Traced only, never run: a collective inside a tf.cond branch lives in the graph's
    # function library, and must still be counted.
    @tf.function
    def step(flag):
        return tf.cond(
            flag,
            lambda: tf.raw_ops.CollectiveReduceV2(
                input=tf.constant([1.0]), group_size=1, group_key=1, instance_key=1,
                ordering_token=[], merge_op="Add", final_op="Id",
            ),
            lambda: tf.constant([0.0]),
        )

    graph = step.get_concrete_function(tf.constant(True)).graph.as_graph_def()
    assert not any(node.op == "CollectiveReduceV2" for node in graph.node)
    assert graph_op_types(graph)["CollectiveReduceV2"] == 1
    assert count_collectives(step, tf.constant(True), replicas=1).all_reduces == 1


def test_asymmetric_counts_are_rejected():
    with pytest.raises(ValueError, match="not a multiple of 2 replicas"):
        _ = CollectiveCount({"CollectiveReduceV2": 3}, replicas=2).all_reduces


def test_count_collectives_needs_a_tf_function():
    with pytest.raises(TypeError, match="needs a tf.function"):
        count_collectives(lambda: None, replicas=1)
