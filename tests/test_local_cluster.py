"""The lab's multi-worker launcher, and the cond error on a real 2-process cluster.

What lesson 06 asserts on its clusters (two workers equal one device, one all-reduce per
step or update, the chief's checkpoint, a dead or late worker) runs there, once per suite:
`make test` executes the lesson."""

import json
import os

import pytest

from distgrad_course.lab.local_cluster import (
    free_ports,
    run_workers,
    tf_config,
    visible_gpus,
    worker_devices,
)

EXPERIMENTS = "distgrad_course.lab.workers"


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


def test_cond_around_apply_gradients_raises_the_merge_call_error_on_mwms_cpu():
    for result in run_workers(f"{EXPERIMENTS}:cond_around_apply", 2, timeout=180):
        assert result.ok, result.stderr_tail
        assert result.value["error"]["type"] == "RuntimeError"
        assert "`merge_call` called while defining a new graph" in result.value["error"]["message"]
