"""`model.fit` on a real 2-process MultiWorkerMirroredStrategy (localhost, one CPU replica
per worker): stock Keras 3 fails; `distgrad.MultiWorkerFit` trains equal to one device,
plain, with `AccumulatingOptimizer` and with `MicroBatching`, from an auto-sharded
tf.data.Dataset and from `distribute_datasets_from_function`, and refuses input it
would split unequally. One cluster runs every fit (`workers_for_tests.fit_on_mwms`)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from workers_for_tests import FIT_EXAMPLES, FIT_GLOBAL_BATCH

from distgrad.multi_worker import (
    MultiWorkerFitModel,
    check_multi_worker_input,
    is_multi_worker,
)
from distgrad_course.lab.compare import OPTIMIZERS, check_close, weights_of
from distgrad_course.lab.data import regression_data, tiny_model
from distgrad_course.lab.local_cluster import run_workers
from distgrad_course.lab.recipes import fit_run

TESTS_ON_PATH = {"PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}  # tests/
PER_REPLICA = "(<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor"

# (name, run): what each entry of the one cluster trains, see fit_on_mwms.
STOCK = {"stock_adam": {"model": "stock"},
         "stock_accumulating": {"model": "stock", "accumulation": "optimizer"},
         "build_fix_only": {"model": "build_fix_only"}}
TRAINED = {  # each variant once per input path, with each optimizer once
    "plain_adam_data": {"validate": True, "checkpoint": True},
    "plain_momentum_function": {"optimizer": "momentum", "data": "function"},
    "accumulating_adam_data": {"accumulation": "optimizer"},
    "accumulating_momentum_function": {"accumulation": "optimizer", "optimizer": "momentum",
                                       "data": "function"},
    "micro_batching_adam_data": {"accumulation": "micro_batching"},
    "micro_batching_momentum_function": {"accumulation": "micro_batching",
                                         "optimizer": "momentum", "data": "function"},
}
REFUSED = {"arrays": {"data": "arrays"}, "shard_off": {"data": "OFF"},
           "no_drop_remainder": {"data": "ragged"}, "jit_compile": {"jit_compile": True},
           "uneven_function": {"data": "uneven_function"}}  # last: it fails mid-step
RUNS = {**TRAINED, **STOCK, **REFUSED}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    checkpoint_dir = tmp_path_factory.mktemp("chief")
    workers = run_workers("workers_for_tests:fit_on_mwms", 2, timeout=400, env=TESTS_ON_PATH,
                          runs=list(RUNS.values()), checkpoint_dir=str(checkpoint_dir))
    for worker in workers:
        worker.check()
    return {"workers": [dict(zip(RUNS, w.value["runs"])) for w in workers],
            "first_example": [w.value["first_example"] for w in workers],
            "replicas": workers[0].value["replicas"], "checkpoint_dir": checkpoint_dir}


@pytest.fixture(scope="module")
def one_device():
    """Keras' own `fit` on one device, global batches of 16, one epoch, per optimizer."""
    x, y = regression_data(FIT_EXAMPLES)
    return {name: fit_run(None, OPTIMIZERS[name], x, y, batch_size=FIT_GLOBAL_BATCH)
            for name in ("adam", "momentum")}


def runs_of(cluster, name):
    return [worker[name] for worker in cluster["workers"]]


# ------------------------------------------------------------------- stock Keras 3

@pytest.mark.parametrize("name", ["stock_adam", "stock_accumulating"])
def test_stock_fit_fails_on_two_workers_before_the_first_step(cluster, name):
    assert cluster["replicas"] == 2
    for run in runs_of(cluster, name):
        assert run["error"]["type"] == "ValueError"
        assert run["error"]["message"].startswith("Attempt to convert a value (PerReplica:{")
        assert f"with an unsupported type {PER_REPLICA}" in run["error"]["message"]
        assert run["iterations"] == 0


def test_past_the_build_stock_keras_fails_reducing_the_scalar_loss(cluster):
    # MultiWorkerFit without its leading axis on the logs: tensorflow/tensorflow#72388.
    for run in runs_of(cluster, "build_fix_only"):
        assert run["error"]["type"] == "ValueError"
        assert run["error"]["message"].startswith(
            "Invalid reduction dimension 0 for input with 0 dimensions.")


# ----------------------------------------------------------------- MultiWorkerFit

@pytest.mark.parametrize("name", TRAINED)
def test_multi_worker_fit_equals_one_device_fit_on_the_global_batch(cluster, one_device, name):
    reference = one_device[TRAINED[name].get("optimizer", "adam")]
    worker0, worker1 = runs_of(cluster, name)
    for run in (worker0, worker1):
        assert run["error"] is None, run["error"]
        assert run["iterations"] == reference.updates == 2  # k=2 micro-steps make one update
        check_close([np.asarray(w) for w in run["weights"]], reference.final)
    assert worker0["weights"] == worker1["weights"]
    assert worker0["history"] == worker1["history"]  # logs averaged over every replica


def test_logged_loss_and_validation_loss_equal_one_device(cluster, one_device):
    reference = one_device["adam"]
    x, y = regression_data(FIT_EXAMPLES)
    val_loss = reference.model.evaluate(x, y, batch_size=FIT_GLOBAL_BATCH, verbose=0)
    for run in runs_of(cluster, "plain_adam_data"):
        assert run["history"]["loss"] == pytest.approx(
            reference.model.history.history["loss"], rel=1e-6)
        assert run["history"]["val_loss"] == pytest.approx([val_loss], rel=1e-6)


def test_the_chief_checkpoint_of_fit_restores_the_one_device_weights(cluster, one_device):
    chief, other = runs_of(cluster, "plain_adam_data")
    assert other["checkpoint"] is None
    path = chief["checkpoint"]
    assert os.path.dirname(path) == str(cluster["checkpoint_dir"])
    assert sorted(os.listdir(cluster["checkpoint_dir"])) == [os.path.basename(path)]
    restored = tiny_model()
    restored.load_weights(path)
    check_close(weights_of(restored), one_device["adam"].final)


# ------------------------------------------------------------- refused input

@pytest.mark.parametrize("name, error_type, fragment", [
    ("arrays", "TypeError", ("`x` must be a tf.data.Dataset or a distributed dataset, got "
                             "ndarray. Fix: tf.data.Dataset.from_tensor_slices((x, y))")),
    ("shard_off", "ValueError", "`x` has AutoShardPolicy.OFF"),
    ("no_drop_remainder", "ValueError", ".batch(global_batch_size, drop_remainder=True)"),
    ("jit_compile", "ValueError", "Compile with jit_compile=False"),
    ("uneven_function", "InvalidArgumentError",
     "MultiWorkerFit: the replicas got batches of different sizes"),
])
def test_input_it_would_split_unequally_fails_with_the_fix(cluster, name, error_type, fragment):
    initial = weights_of(tiny_model())
    for run in runs_of(cluster, name):
        assert run["error"]["type"] == error_type
        assert fragment in run["error"]["message"]
        assert run["iterations"] == 0  # nothing was applied
        np.testing.assert_array_equal(np.concatenate([np.ravel(w) for w in run["weights"]]),
                                      np.concatenate([np.ravel(w) for w in initial]))


def test_auto_sharding_off_gives_every_worker_the_same_examples(cluster):
    worker0, worker1 = cluster["first_example"]
    assert worker0["OFF"] == worker1["OFF"]  # why OFF is refused
    assert worker0["DATA"] != worker1["DATA"]
    x, _ = regression_data(FIT_EXAMPLES)
    np.testing.assert_array_equal(worker0["DATA"], x[0])
    np.testing.assert_array_equal(worker1["DATA"], x[FIT_GLOBAL_BATCH // 2])


# ------------------------------------------------- without a cluster (this process)

def dataset(batch, policy="DATA", drop_remainder=True):
    x, y = regression_data(FIT_EXAMPLES)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy)
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .batch(batch, drop_remainder=drop_remainder).with_options(options))


@pytest.mark.parametrize("policy", ["AUTO", "DATA", "FILE"])
def test_a_sharded_dataset_with_a_static_divisible_batch_is_accepted(policy):
    check_multi_worker_input(dataset(16, policy), num_replicas=2)


def test_a_distributed_dataset_is_accepted_and_checked_at_run_time(strategy2):
    check_multi_worker_input(strategy2.experimental_distribute_dataset(dataset(16)), 2)


@pytest.mark.parametrize("data, num_replicas, error, fragment", [
    (np.zeros((4, 1)), 2, TypeError, "got ndarray"),
    (dataset(16, "OFF"), 2, ValueError, "AutoShardPolicy.OFF, so TensorFlow does not split"),
    (dataset(16, "HINT"), 2, ValueError, "AutoShardPolicy.HINT"),
    (dataset(16, drop_remainder=False), 2, ValueError, "have no static size"),
    (dataset(16), 3, ValueError, "[16] examples, does not split into 3 equal"),
], ids=["arrays", "off", "hint", "dynamic", "indivisible"])
def test_input_check_names_the_fix(data, num_replicas, error, fragment):
    with pytest.raises(error, match="MultiWorkerFit") as raised:
        check_multi_worker_input(data, num_replicas, "validation_data")
    assert fragment in str(raised.value)
    assert "validation_data" in str(raised.value)


def test_on_one_process_it_is_keras_own_fit(strategy2):
    assert not is_multi_worker(strategy2)
    assert not is_multi_worker(tf.distribute.get_strategy())
    x, y = regression_data(FIT_EXAMPLES)

    def model():
        layers = tiny_model()
        return MultiWorkerFitModel(layers.inputs, layers.outputs)

    run = fit_run(strategy2, OPTIMIZERS["adam"], x, y, batch_size=FIT_GLOBAL_BATCH,
                  model_factory=model)
    check_close(run.final, fit_run(None, OPTIMIZERS["adam"], x, y, FIT_GLOBAL_BATCH).final)


def test_the_model_class_is_registered_for_saving():
    assert keras.saving.get_registered_object("distgrad>MultiWorkerFitModel") is MultiWorkerFitModel


def test_the_input_check_reads_fit_arguments_through_a_micro_batching_mixin(monkeypatch):
    """`class M(MultiWorkerFit, MicroBatching, keras.Model)`: `MicroBatching.fit` takes
    (*args, **kwargs), so the check binds `fit`'s arguments to Keras' own signature."""
    import distgrad.multi_worker as multi_worker
    from distgrad.train_step import MicroBatching

    monkeypatch.setattr(multi_worker, "is_multi_worker", lambda strategy: True)
    layers = tiny_model()
    model = type("Both", (multi_worker.MultiWorkerFit, MicroBatching, keras.Model), {})(
        layers.inputs, layers.outputs, accumulation_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = regression_data(FIT_EXAMPLES)
    with pytest.raises(TypeError, match="`x` must be a tf.data.Dataset"):
        model.fit(x, y, batch_size=FIT_GLOBAL_BATCH, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
