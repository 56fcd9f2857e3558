"""Lesson 06: real 2-process MultiWorkerMirroredStrategy runs on localhost."""

import json
import os

import pytest

from distgrad.lab.multiworker import (
    free_ports,
    run_workers,
    tf_config,
    visible_gpus,
    worker_devices,
)

EXPERIMENTS = "distgrad.lab.workers"


def test_tf_config_names_every_worker_and_this_task():
    config = json.loads(tf_config([1111, 2222], 1))
    assert config == {"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]},
                      "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize("gpus, expected", [
    ([], ["", ""]),
    (["0"], ["", ""]),  # one GPU for two workers: neither gets it, they would compete
    (["0", "1"], ["0", "1"]),
    (["3", "5", "6", "7"], ["3,5", "6,7"]),  # ids as CUDA_VISIBLE_DEVICES listed them
    (["0", "1", "2"], ["0", "1"]),
])
def test_each_worker_sees_its_own_gpus_or_only_the_cpu(gpus, expected):
    assert [worker_devices(i, 2, gpus)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == expected


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 4")
    assert visible_gpus() == ["2", "4"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_free_ports_are_distinct():
    ports = free_ports(3)
    assert len(set(ports)) == 3


def test_bad_launcher_arguments_fail_before_starting_workers():
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        run_workers(f"{EXPERIMENTS}:train_on_worker", 0)
    with pytest.raises(ValueError, match="package.module:function"):
        run_workers("no_colon_here", 2)


def test_a_hanging_worker_is_killed_at_the_timeout(tmp_path):
    marker = tmp_path / "pids"
    with pytest.raises(TimeoutError, match="did not finish within 5 s; all workers were killed"):
        run_workers("workers_for_tests:sleep_forever", 2, timeout=5,
                    env={"PYTHONPATH": os.path.dirname(__file__)}, pid_file=str(marker))
    pids = marker.read_text().split()
    assert len(pids) == 2  # both workers were running when the timeout hit
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


@pytest.fixture(scope="module")
def adam_on_two_workers():
    return run_workers(f"{EXPERIMENTS}:train_on_worker", 2, timeout=180,
                       optimizer="adam", steps=3)


def test_two_workers_equal_one_device_with_one_all_reduce_per_step(adam_on_two_workers):
    import numpy as np

    from distgrad.lab.compare import OPTIMIZERS, check_close
    from distgrad.lab.data import regression_data
    from distgrad.lab.recipes import big_batch_reference
    from distgrad.lab.workers import GLOBAL_BATCH

    x, y = regression_data(GLOBAL_BATCH)
    reference = big_batch_reference(OPTIMIZERS["adam"], x, y, steps=3)
    for task_index, result in enumerate(adam_on_two_workers):
        assert result.ok, result.stderr_tail
        value = result.value
        assert value["tf_config"]["task"] == {"type": "worker", "index": task_index}
        assert value["task"] == ["worker", task_index]  # the strategy read TF_CONFIG
        assert value["replicas"] == 2
        own_gpus = worker_devices(task_index, 2, visible_gpus())["CUDA_VISIBLE_DEVICES"]
        device = "device:GPU:0" if own_gpus else "device:CPU:0"
        assert [d.rsplit("/", 1)[-1] for d in value["local_devices"]] == [device]
        assert value["collective_op_types"] == {"CollectiveReduceV2": 1}
        assert value["iterations"] == 3
        check_close([np.asarray(w) for w in value["weights"]], reference)


def test_mwms_on_cpu_still_uses_merge_call(adam_on_two_workers):
    # _use_merge_call() is False only for XLA-compiled steps on all-GPU devices.
    assert all(r.value["supports_no_merge_call"] is False for r in adam_on_two_workers)


def test_a_strategy_created_after_the_runtime_started_is_refused():
    (result,) = run_workers(f"{EXPERIMENTS}:strategy_after_runtime_start", 1, timeout=120)
    assert result.ok, result.stderr_tail
    assert result.value["error"] == {"type": "RuntimeError",
                                     "message": "Collective ops must be configured at program startup"}


def test_cond_around_apply_gradients_raises_the_merge_call_error_on_mwms_cpu():
    for result in run_workers(f"{EXPERIMENTS}:cond_around_apply", 2, timeout=180):
        assert result.ok, result.stderr_tail
        assert result.value["error"]["type"] == "RuntimeError"
        assert "`merge_call` called while defining a new graph" in result.value["error"]["message"]


def test_a_dead_worker_makes_the_survivor_fail_fast_instead_of_hanging():
    results = run_workers(f"{EXPERIMENTS}:dead_worker", 2, timeout=120, collective_timeout=10.0)
    survivor, dead = results
    assert dead.returncode == 3 and not dead.reported and dead.value is None
    assert survivor.ok, survivor.stderr_tail
    assert survivor.value["error"]["type"] in {"UnavailableError", "DeadlineExceededError"}
    assert survivor.value["seconds"] < 10.0 + 5.0


def test_the_chief_checkpoint_restores_the_one_device_weights(tmp_path):
    import keras
    import tensorflow as tf

    from distgrad.lab.compare import check_close, weights_of
    from distgrad.lab.data import regression_data, tiny_model
    from distgrad.lab.recipes import big_batch_reference

    chief, other = run_workers(f"{EXPERIMENTS}:checkpoint_from_chief", 2, timeout=180,
                               directory=str(tmp_path), steps=2)
    assert chief.ok and other.ok, chief.stderr_tail + other.stderr_tail
    assert chief.value["is_chief"] and chief.value["path"].startswith(str(tmp_path))
    assert other.value["path"] is None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-1"))

    model, optimizer = tiny_model(), keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(chief.value["path"]).assert_consumed()
    x, y = regression_data(16)
    check_close(weights_of(model), big_batch_reference(lambda: keras.optimizers.SGD(0.1), x, y, steps=2))
    assert int(optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("recipe", ["accumulator", "optimizer"])
def test_accumulation_on_two_workers_equals_one_device_with_one_all_reduce_per_update(recipe):
    results = run_workers(f"{EXPERIMENTS}:accumulated_equivalence", 2, timeout=180,
                          recipe=recipe, optimizer="adam", accumulation_steps=2, updates=2)
    for result in results:
        assert result.ok, result.stderr_tail
        value = result.value
        assert value["iterations"] == 2  # updates, not micro-steps
        assert value["max_abs_diff_vs_one_device"] <= 1e-6
        if recipe == "accumulator":  # accumulate: no communication; apply: one all-reduce
            assert value["all_reduce_ops_per_micro_step_function"] == 0
            assert value["all_reduce_ops_per_apply_function"] == 1
        else:  # the one all-reduce sits inside the update branch of the micro-step
            assert value["all_reduce_ops_per_micro_step_function"] == 1
