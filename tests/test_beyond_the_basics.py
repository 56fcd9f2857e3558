"""Lesson 07: uneven token counts, BatchNorm statistics, sparse embedding gradients.

Lesson 07 runs and asserts each pitfall's reproduction on R replicas (once per suite);
here: other sizes, one replica, the helpers, and resuming in a fresh process."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from distgrad.normalization import count_tokens, token_loss
from distgrad.sparse import deduplicate, dense_bytes, has_duplicate_indices, sparse_bytes
from distgrad_course.pitfalls import batchnorm_statistics, mean_of_means, sparse_duplicates

TOL = 1e-6


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_mean_of_micro_batch_means_is_not_the_big_batch_gradient(micro_batches):
    record = mean_of_means.reproduce(micro_batches)
    assert len(set(record.token_counts)) > 1  # the micro-batches really are uneven
    assert record.mean_of_means_vs_big_batch > 0.1 * record.gradient_scale
    assert record.global_count_vs_big_batch <= TOL


def test_token_loss_divides_the_masked_sum_by_the_given_count():
    loss = tf.constant([[1.0, 2.0, 100.0]])
    mask = tf.constant([[1.0, 1.0, 0.0]])
    assert float(token_loss(loss, mask, 4.0)) == pytest.approx(0.75)
    assert float(count_tokens(mask)) == 2.0
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        token_loss(loss, mask, 0.0)


def test_batchnorm_on_one_replica_without_accumulation_is_the_big_batch(strategy1):
    record = batchnorm_statistics.reproduce(strategy1)
    assert record.replicas_plain_bn.max_abs == 0.0


def test_plain_sgd_does_not_care_about_duplicates():  # lesson 07: with momentum, and Adam
    def sgd():
        return keras.optimizers.SGD(0.1)

    assert sparse_duplicates.reproduce((1, 1, 2), optimizer_factory=sgd).sparse_vs_dense <= TOL


def test_deduplicate_sums_repeated_rows_and_keeps_the_dense_value():
    slices = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]), tf.constant([3, 1, 3]),
                              tf.constant([5, 1]))
    assert has_duplicate_indices(slices)
    unique = deduplicate(slices)
    assert not has_duplicate_indices(unique)
    np.testing.assert_array_equal(tf.convert_to_tensor(unique), tf.convert_to_tensor(slices))
    assert sorted(unique.indices.numpy().tolist()) == [1, 3]
    dense = tf.ones([2, 2])
    assert deduplicate(dense) is dense
    assert dense_bytes(slices) == 5 * 4 and sparse_bytes(slices) == 3 * 4 + 3 * 4


def test_resume_mid_accumulation_in_a_fresh_process_equals_the_uninterrupted_run(
        strategy2, tmp_path):
    from distgrad_course.lab import resume
    from distgrad_course.lab.compare import check_close

    report = resume.resume_in_fresh_processes(str(tmp_path), replicas=2)
    assert report["first"] == {"iterations": 1, "micro_steps": 6}
    assert (report["rest"]["restored_iterations"], report["rest"]["restored_micro_steps"]) == (1, 6)
    assert (report["rest"]["iterations"], report["rest"]["micro_steps"]) == (2, 8)
    check_close(report["weights"], resume.uninterrupted_weights(strategy2))
