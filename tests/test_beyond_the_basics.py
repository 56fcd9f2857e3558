"""Lesson 07: uneven token counts, BatchNorm statistics, sparse embedding gradients.

Lesson 07 runs and asserts each pitfall's reproduction on R replicas (once per suite);
here: other sizes, one replica, and resuming in a fresh process (the helpers' specs are
test_normalization.py and test_sparse.py)."""

import keras
import pytest

from distgrad_course.pitfalls import batchnorm_statistics, mean_of_means, sparse_duplicates

TOL = 1e-6


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_mean_of_micro_batch_means_is_not_the_big_batch_gradient(micro_batches):
    record = mean_of_means.reproduce(micro_batches)
    assert len(set(record.token_counts)) > 1  # the micro-batches really are uneven
    assert record.mean_of_means_vs_big_batch > 0.1 * record.gradient_scale
    assert record.global_count_vs_big_batch <= TOL


def test_batchnorm_on_one_replica_without_accumulation_is_the_big_batch(strategy1):
    record = batchnorm_statistics.reproduce(strategy1)
    assert record.replicas_plain_bn.max_abs == 0.0


def test_plain_sgd_does_not_care_about_duplicates():  # lesson 07: with momentum, and Adam
    def sgd():
        return keras.optimizers.SGD(0.1)

    assert sparse_duplicates.reproduce((1, 1, 2), optimizer_factory=sgd).sparse_vs_dense <= TOL


def test_resume_mid_accumulation_in_a_fresh_process_equals_the_uninterrupted_run(
        strategy2, tmp_path):
    from distgrad_course.lab import resume
    from distgrad_course.lab.compare import check_close

    report = resume.resume_in_fresh_processes(str(tmp_path), replicas=2)
    assert report["first"] == {"iterations": 1, "micro_steps": 6}
    assert (report["rest"]["restored_iterations"], report["rest"]["restored_micro_steps"]) == (1, 6)
    assert (report["rest"]["iterations"], report["rest"]["micro_steps"]) == (2, 8)
    check_close(report["weights"], resume.uninterrupted_weights(strategy2))
