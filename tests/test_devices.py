import os

import pytest

from distgrad_course.devices import DevicePlan, environment_report, plan_devices, resolve_replicas
from distgrad_course.lab.child import run_child

TESTS_ON_PATH = {"PYTHONPATH": os.path.dirname(__file__)}


def test_plan_uses_gpus_when_enough_are_visible():
    assert plan_devices(2, physical_gpus=4) == DevicePlan("GPU", 2, split=False)


def test_plan_splits_a_single_gpu_into_logical_gpus():
    assert plan_devices(2, physical_gpus=1) == DevicePlan("GPU", 2, split=True)


def test_plan_falls_back_to_logical_cpus_without_gpus():
    assert plan_devices(2, physical_gpus=0) == DevicePlan("CPU", 2, split=True)
    assert plan_devices(1, physical_gpus=0) == DevicePlan("CPU", 1, split=False)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_replicas_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        resolve_replicas(bad)


def test_replicas_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("DISTGRAD_REPLICAS", "3")
    assert resolve_replicas() == 3
    monkeypatch.setenv("DISTGRAD_REPLICAS", "two")
    with pytest.raises(ValueError, match="DISTGRAD_REPLICAS must be a whole number"):
        resolve_replicas()


def test_two_replica_strategy_runs_on_two_cpu_devices(strategy2):
    report = environment_report(strategy2)
    assert report["replicas"] == 2
    assert [d.rsplit(":", 2)[-2:] for d in report["devices"]] == [["CPU", "0"], ["CPU", "1"]]
    assert report["cross_device_ops"] == "CollectiveAllReduce"


def test_make_strategy_turns_tensor_float_32_off(strategy2):
    assert environment_report(strategy2)["tensor_float_32"] is False


def test_the_same_devices_give_the_same_strategy(strategy2):
    import distgrad_course

    assert distgrad_course.make_strategy(2) is strategy2
    assert distgrad_course.make_strategy(1) is not strategy2


def test_fewer_replicas_than_configured_is_fine(strategy1):
    assert strategy1.num_replicas_in_sync == 1


def test_make_strategy_after_runtime_init_raises_with_the_fix():
    result = run_child("workers_for_tests:strategy_after_runtime_init", env=TESTS_ON_PATH,
                       check=False)
    assert result.reported and result.error["type"] == "RuntimeError", result.stderr_tail
    message = result.error["message"]
    assert "already initialized" in message
    assert "restart the kernel" in message
    assert "DISTGRAD_REPLICAS=1" in message


def test_distgrad_replicas_environment_variable_chooses_the_count():
    result = run_child("workers_for_tests:replicas_in_sync",
                       env={**TESTS_ON_PATH, "DISTGRAD_REPLICAS": "3"})
    assert result.value == 3


def test_whole_gpus_grow_their_memory_so_processes_can_share_them(monkeypatch):
    # Simulated: TensorFlow here sees no GPU, so tf.config answers as on a 2-GPU machine.
    import tensorflow as tf

    from distgrad_course.devices import replica_devices

    gpus = ["GPU:0", "GPU:1"]
    grown = []
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: gpus if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "get_logical_device_configuration", lambda device: None)
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                        lambda device, enable: grown.append((device, enable)))
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: [type("D", (), {"name": f"/{g}"}) for g in gpus])
    assert replica_devices(2) == ["/GPU:0", "/GPU:1"]
    assert grown == [("GPU:0", True), ("GPU:1", True)]
