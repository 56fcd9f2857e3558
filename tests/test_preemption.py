"""Preemption mid-cycle (issue 26, custom loops): checkpoint a `GradientAccumulator` loop
after micro-batch 4 of 12 (k=3: one update done, one micro-batch of the next accumulated)
and resume it exactly: in a fresh process on MirroredStrategy, and on a 2-worker
MultiWorkerMirroredStrategy cluster under `PreemptionCheckpointHandler` after a SIGTERM
(the handler saves) or a SIGKILL (the last periodic save), restarted by the lab's cluster
manager, `distgrad_course.lab.cluster_manager.run_cluster_with_restarts`. A dead or missing worker
ends in bounded time, never a hang.

Every run is compared with one device training on the big batches (a fresh process) and,
on the cluster, with the same cluster run without faults, float32 to rtol 1e-6. Lesson 08
runs (and asserts) what is not repeated here: which iterators `tf.train.Checkpoint`
accepts, and the SIGTERM, SIGKILL and no-sync SIGTERM scenarios on the cluster."""

from __future__ import annotations

import time

import numpy as np
import pytest

from distgrad_course.lab import custom_loop_resume, preemption
from distgrad_course.lab.child import run_child
from distgrad_course.lab.cluster_manager import (
    Fault,
    RestartsExhausted,
    read_progress,
    run_cluster_with_restarts,
)
from distgrad_course.lab.compare import weight_diff
from distgrad_course.lab.custom_loop_resume import (
    ACCUMULATION_STEPS,
    MICRO_STEPS,
    SPLIT,
    load_weights,
)

RTOL, ATOL = 1e-6, 1e-7
UPDATES = MICRO_STEPS // ACCUMULATION_STEPS
NOT_TRACKABLE = ("`Checkpoint` was expecting iterator to be a trackable object (an object "
                 "derived from `Trackable`), got <tensorflow.python.distribute.input_lib."
                 "DistributedIterator object at ")


def assert_weights_equal(actual, expected):
    assert len(actual) == len(expected) == 4
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def reference():
    """One device, one Adam step per 3 global micro-batches, in a fresh process (the
    shuffle order depends on TensorFlow's global seed, which other tests may have set)."""
    return [np.asarray(w, np.float32)
            for w in run_child("distgrad_course.lab.custom_loop_resume:reference_weights").value]


# ------------------------------------------------------------ one process, 2 replicas


@pytest.mark.parametrize("reshuffle", [True, False])
def test_a_plain_iterator_checkpoint_continues_a_shuffled_repeated_pipeline(tmp_path, reshuffle):
    import tensorflow as tf

    def pipeline():
        return (tf.data.Dataset.range(12).shuffle(12, seed=7, reshuffle_each_iteration=reshuffle)
                .repeat(3).batch(4))

    iterator = iter(pipeline())
    read = [next(iterator).numpy().tolist() for _ in range(2)]
    path = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "it"))
    rest = [b.numpy().tolist() for b in iterator]
    restored = iter(pipeline())
    tf.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
    assert [b.numpy().tolist() for b in restored] == rest
    examples = np.concatenate(read + rest)
    assert examples.shape == (36,)
    epochs = examples.reshape(3, 12)
    assert (np.sort(epochs, axis=1) == np.arange(12)).all()  # each epoch one permutation
    assert len({tuple(e) for e in epochs.tolist()}) == (3 if reshuffle else 1)


def test_skip_relies_on_the_first_iteration_of_a_new_pipeline():
    """`skip(n)` on a pipeline built afresh continues where the first iteration of any
    fresh one was; iterating the *same* reshuffling dataset again gives a new order."""
    first = [x.numpy().tolist() for x, _ in custom_loop_resume.global_micro_batches()]
    again = [x.numpy().tolist() for x, _ in custom_loop_resume.global_micro_batches()]
    skipped = [x.numpy().tolist() for x, _ in custom_loop_resume.global_micro_batches().skip(SPLIT)]
    assert len(first) == MICRO_STEPS
    assert again == first
    assert skipped == first[SPLIT:]
    dataset = custom_loop_resume.global_micro_batches()
    once = [x.numpy().tolist() for x, _ in dataset]
    twice = [x.numpy().tolist() for x, _ in dataset]
    assert once == first
    assert twice != once


@pytest.fixture(scope="module")
def resumed_with_skip(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume-skip")
    return str(workdir), custom_loop_resume.resume_custom_loop(str(workdir), data="skip")


@pytest.mark.parametrize("data", custom_loop_resume.DATA_MODES)
def test_custom_loop_resumes_mid_cycle_in_a_fresh_process(data, resumed_with_skip, tmp_path,
                                                          reference):
    if data == "skip":
        reports = resumed_with_skip[1]
    else:
        reports = custom_loop_resume.resume_custom_loop(str(tmp_path), data=data)
    first, rest = reports["first"], reports["rest"]
    # Saved after micro-batch 4: one update done, one micro-batch of the next accumulated.
    assert first["saved"]["iterations"] == 1 and first["saved"]["micro_steps"] == 1
    assert rest["restored"] == {"iterations": 1, "micro_steps": 1, "micro_batches": SPLIT}
    for report in (first, rest):
        assert (report["iterations"], report["micro_steps"], report["micro_batches"]) == (
            UPDATES, 0, MICRO_STEPS)
    assert_weights_equal(rest["weights"], first["weights"])  # the uninterrupted run
    assert_weights_equal(first["weights"], reference)
    assert_weights_equal(rest["weights"], reference)


def test_resuming_without_the_accumulator_loses_the_accumulated_micro_batch(resumed_with_skip):
    """The control: the same checkpoint restored without the accumulator starts the
    second cycle with 0 micro-batches instead of 1, and the weights come out different."""
    workdir, reports = resumed_with_skip
    rest = run_child("distgrad_course.lab.custom_loop_resume:custom_loop",
                     {"workdir": workdir, "phase": "rest", "without_accumulator": True}).value
    assert rest["restored"] == {"iterations": 1, "micro_steps": 0, "micro_batches": SPLIT}
    weights = load_weights(rest["weights_file"])
    assert weight_diff(weights, reports["first"]["weights"]).max_abs > 1e-4


# ------------------------------------------------------- a 2-worker cluster (MWMS)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return preemption.uninterrupted_cluster(str(tmp_path_factory.mktemp("uninterrupted")))


def test_two_workers_without_faults_equal_one_device(uninterrupted, reference):
    assert_weights_equal(uninterrupted["weights"], reference)
    for worker in uninterrupted["workers"]:
        assert worker["restored"]["checkpoint"] is None
        assert (worker["optimizer_iterations"], worker["accumulator_micro_steps"],
                worker["micro_batches"], worker["total_run_calls"]) == (
            UPDATES, 0, MICRO_STEPS, MICRO_STEPS)  # total_run_calls: one per micro-batch
        # On MWMS too, a distributed iterator cannot go into a checkpoint.
        assert worker["iterator_checkpoint_error"]["type"] == "ValueError"
        assert worker["iterator_checkpoint_error"]["message"].startswith(NOT_TRACKABLE)
        # Each micro-batch all-reduces twice: the finite pipeline's has-data flag
        # (the distributed iterator's get_next_as_optional) and the summed loss.
        assert worker["all_reduce_ops_per_accumulate"] == 2


def test_a_survivor_without_a_cluster_manager_fails_by_itself_within_bounded_time(tmp_path):
    report = preemption.preemption_experiment("SIGKILL_survivor_alone", str(tmp_path))
    (attempt,) = report["attempts"]
    assert attempt["returncodes"] == [1, -9] and attempt["killed_by_launcher"] == []
    assert not attempt["timed_out"]
    error = report["worker_errors"][0][0]
    # Whichever notices first: the coordination service's missed heartbeats or the
    # collective timeout (10 s here).
    expected = {"UnavailableError": "The following tasks are unhealthy (stopped sending "
                                    "heartbeats):\n/job:worker/replica:0/task:1",
                "DeadlineExceededError": "Collective has timed out during execution."}
    assert error["type"] in expected and expected[error["type"]] in error["message"], error
    failed_after = attempt["worker_seconds"][0] - attempt["signals"][0]["seconds"]
    assert 0 < failed_after < 60, failed_after


def test_a_worker_that_never_comes_back_ends_in_bounded_time(tmp_path):
    started = time.monotonic()
    with pytest.raises(RestartsExhausted,
                       match=r"the cluster failed 2 times \(max_restarts=1\); gave up.") as info:
        run_cluster_with_restarts(preemption.WORKER, 2, str(tmp_path),
                                  **preemption.SCENARIOS["worker_never_returns"])
    elapsed = time.monotonic() - started
    assert elapsed < 60, elapsed
    attempts = info.value.attempts
    assert len(attempts) == 2
    for attempt in attempts:
        assert attempt.absent == [1] and attempt.timed_out
        assert attempt.killed_by_launcher == [0] and attempt.returncodes == [-9, None]
        # No strategy record: the chief was still in the strategy's constructor when the
        # launcher killed it (it waits there for worker 1 to join).
        assert read_progress(str(tmp_path), attempt.index, 0, "strategy") is None
    assert "attempt 1: exit codes [-9, None], signals [], absent [1], killed by the " \
           "launcher [0], timed out" in str(info.value)


def test_the_launcher_rejects_bad_arguments_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of"):
        Fault(1, "SIGSTOP")
    with pytest.raises(ValueError, match=r"a fault for worker 2, but the workers are 0..1"):
        run_cluster_with_restarts(preemption.WORKER, 2, str(tmp_path), faults=[Fault(2)])
    with pytest.raises(ValueError, match="max_restarts must be an integer >= 0"):
        run_cluster_with_restarts(preemption.WORKER, 2, str(tmp_path), max_restarts=-1)
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        run_cluster_with_restarts(preemption.WORKER, 0, str(tmp_path))
    assert list(tmp_path.iterdir()) == []
