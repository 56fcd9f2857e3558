"""Each reference file refuses, at import, a TensorFlow or Keras older than the oldest the
version matrix passes (docs/versions.md): an ImportError naming the fix, not a failure deep
inside Keras. The bounds are pyproject.toml's.

On TensorFlow 2.15 (the `tf2.15` cell of `make matrix`; skipped on Keras 3), whose own
tf.keras is Keras 2.15 and which has no Keras 3: `import distgrad` works, a Keras-3-only
name says what to use instead, and, in children without `TF_USE_LEGACY_KERAS` (plain
tf.keras, as the questions' askers ran it), `distgrad.tf_keras.AccumulatingOptimizer` in
`model.fit` (float32 and mixed_float16) and `distgrad.GradientAccumulator` in a custom loop
each equal one big-batch step on 2 replicas."""

import importlib
import os
import pathlib
import re
import runpy

import keras
import numpy as np
import pytest
import tensorflow as tf

from distgrad_course.lab.compare import check_close
from distgrad_course.lab.data import regression_data
from distgrad_course.lab.tf_keras_runner import run_tf_keras

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = ("optimizer", "accumulator", "train_step", "mixed_precision", "multi_worker")
FIX = "pip install -U 'tensorflow>=2.16' 'keras>=3.10'"
KERAS_2 = keras.__version__.startswith("2.")
keras_3_only = pytest.mark.skipif(KERAS_2, reason="Keras 3 process (keras is 2.x here)")
keras_2_only = pytest.mark.skipif(
    not KERAS_2, reason="TensorFlow 2.15's own Keras 2: run by the tf2.15 cell of make matrix")
# A child with plain tf.keras: no TF_USE_LEGACY_KERAS (TensorFlow 2.15 fails to import
# tf.keras with it and no tf-keras), tests/ on the path for tf_keras_children.
PLAIN_TF_KERAS = {"PYTHONPATH": os.path.dirname(__file__), "TF_USE_LEGACY_KERAS": None}
REPLICAS, MICRO_BATCH, K = 2, 8, 2


def declared_lower_bounds() -> dict:
    """The Keras 3 path's bounds: TensorFlow 2.16 (its first with Keras 3) and the oldest
    Keras 3 that pyproject.toml does not exclude (`!=3.N.*` for each older minor)."""
    text = (ROOT / "pyproject.toml").read_text()
    keras_spec = re.search(r'"keras(>=[^"]+)"', text)[1]
    excluded = [int(n) for n in re.findall(r"!=3\.(\d+)\.\*", keras_spec)]
    assert excluded == list(range(len(excluded))), keras_spec  # 3.0 ... 3.N, none skipped
    return {"tensorflow": (2, 16), "keras": (3, len(excluded))}


def test_pyproject_lets_tensorflow_2_15_bring_its_keras_2_15():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"tensorflow>=2.15"' in text and re.search(r'"keras>=2\.15,!=3\.0\.\*', text)
    assert '"tf-keras>=2.15"' in text


def import_copy(monkeypatch, name, tf_version, keras_version):
    """Run src/distgrad/NAME.py as a copied file would be imported, under these versions
    (its Keras registrations left out, so the real classes stay registered)."""
    monkeypatch.setattr(tf, "__version__", tf_version)
    monkeypatch.setattr(keras, "__version__", keras_version)
    monkeypatch.setattr(keras.saving, "register_keras_serializable",
                        lambda **_: lambda cls: cls)
    return runpy.run_path(str(ROOT / "src" / "distgrad" / f"{name}.py"))


@keras_3_only
@pytest.mark.parametrize("name", MODULES)
def test_each_reference_file_needs_what_pyproject_declares(name):
    assert importlib.import_module(f"distgrad.{name}").NEEDED == declared_lower_bounds()


@keras_3_only
@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("tf_version, keras_version", [
    ("2.21.0", "3.9.2"), ("2.21.0", "3.3.0"), ("2.15.1", "2.15.0"), ("2.15.1", "3.15.1"),
    ("2.14.1", "2.14.0"), ("2.16.1", "2.15.0")])
def test_an_older_tensorflow_or_keras_is_refused_at_import_naming_the_fix(
        monkeypatch, name, tf_version, keras_version):
    if name == "accumulator" and (tf_version, keras_version) == ("2.15.1", "2.15.0"):
        pytest.skip("GradientAccumulator takes TensorFlow 2.15's Keras 2.15 (tested below)")
    with pytest.raises(ImportError) as refused:
        import_copy(monkeypatch, name, tf_version, keras_version)
    either = " (or TensorFlow 2.15 with its Keras 2.15)" if name == "accumulator" else ""
    assert str(refused.value) == (
        f"distgrad.{name} needs TensorFlow >= 2.16 and Keras >= 3.10{either}, found TensorFlow "
        f"{tf_version} and Keras {keras_version}: {FIX}")


@keras_3_only
def test_the_accumulator_copy_takes_tensorflow_2_15_with_its_keras_2_15(monkeypatch):
    assert import_copy(monkeypatch, "accumulator", "2.15.1", "2.15.0")["KERAS_2"]


@keras_3_only
@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("tf_version, keras_version", [
    ("2.16.0", "3.10.0"), ("2.16.0rc0", "3.10.0rc1"), ("2.22.0", "3.16.0.dev2026")])
def test_the_oldest_declared_versions_and_newer_ones_import(monkeypatch, name, tf_version,
                                                            keras_version):
    assert import_copy(monkeypatch, name, tf_version, keras_version)["NEEDED"]


# -- TensorFlow 2.15, its own tf.keras (Keras 2.15); the tf2.15 cell of make matrix --------


@keras_2_only
def test_import_distgrad_works_and_a_keras_3_name_says_what_to_use_instead():
    import distgrad
    import distgrad.tf_keras

    assert tf.__version__.startswith("2.15.") and keras.__version__.startswith("2.15.")
    assert tf.keras.Model.__module__.startswith("keras.src.engine.")  # no tf-keras switch
    assert distgrad.GradientAccumulator.__module__ == "distgrad.accumulator"
    assert keras.saving.get_registered_object("distgrad>AccumulatingOptimizer") is (
        distgrad.tf_keras.AccumulatingOptimizer)
    with pytest.raises(ImportError, match=r"distgrad.AccumulatingOptimizer needs Keras 3 "
                       r"\(TensorFlow >= 2.16\), but keras is 2.15.\d+ here: use "
                       r"distgrad.tf_keras.AccumulatingOptimizer \(tf.keras, Keras 2\)"):
        distgrad.AccumulatingOptimizer  # noqa: B018
    with pytest.raises(ImportError, match="distgrad.MicroBatching needs Keras 3"):
        from distgrad import MicroBatching  # noqa: F401


@keras_2_only
def test_fit_on_plain_tf_keras_2_15_equals_one_big_batch_step():
    x, y = regression_data(MICRO_BATCH * K * 2)
    fits = run_tf_keras("tf_keras_children:fit_equivalence", REPLICAS, env=PLAIN_TF_KERAS,
                      x=x.tolist(), y=y.tolist(), micro_batch=MICRO_BATCH,
                      accumulation_steps=K, names=["adam", "legacy momentum"])
    assert fits.replicas == REPLICAS and fits.tf_keras.startswith("2.15.")
    for name in ("adam", "legacy momentum"):
        assert fits[name]["optimizer"] == "AccumulatingOptimizer"
        check_close(fits[name]["accumulated"], fits[name]["big_batch"], what=name)  # 1e-6


@keras_2_only
def test_fit_under_mixed_float16_on_plain_tf_keras_2_15_equals_the_mixed_big_batch():
    from distgrad_course.lab.mixed import check_float16_close, overflow_data

    micro_batches, overflow = 7, 3  # as tests/tf_keras_optimizer/test_tf_keras_mixed_precision.py
    x, y = overflow_data(micro_batches - 1, MICRO_BATCH, None, REPLICAS)
    x7, y7 = overflow_data(micro_batches, MICRO_BATCH, overflow, REPLICAS,
                           overflow_replicas=(1,))
    keep = np.r_[0:(overflow - 1) * MICRO_BATCH, overflow * MICRO_BATCH:len(x7)]
    mixed = run_tf_keras("tf_keras_children:mixed_precision", REPLICAS, env=PLAIN_TF_KERAS,
                       x=x.tolist(), y=y.tolist(), overflowing=[x7.tolist(), y7.tolist()],
                       without=[x7[keep].tolist(), y7[keep].tolist()], micro_batch=MICRO_BATCH,
                       accumulation_steps=K, initial_scale=2.0**10, stop_after=overflow + 1)
    assert mixed.tf_keras.startswith("2.15.")
    assert mixed["compiled"] == ["LossScaleOptimizerV3", "AccumulatingOptimizer", True]
    per_replica = K * MICRO_BATCH // REPLICAS  # the most examples one replica sums in float16
    for name in ("adam", "adam, stock train_step"):
        check_float16_close(mixed[name]["accumulated"], mixed[name]["big_batch"],
                            mixed["initial"], per_replica, what=name)
    # an overflow on replica 1 only: that micro-batch skipped everywhere, as if absent
    check_float16_close(mixed["overflow"]["accumulated"], mixed["overflow"]["big_batch_without"],
                        mixed["initial"], per_replica)


@keras_2_only
def test_gradient_accumulator_in_a_custom_loop_on_plain_tf_keras_2_15_equals_big_batch():
    x, y = regression_data(MICRO_BATCH * K * 2)
    loops = run_tf_keras("tf_keras_children:custom_loops", REPLICAS, env=PLAIN_TF_KERAS,
                       x=x.tolist(), y=y.tolist(), micro_batch=MICRO_BATCH,
                       accumulation_steps=K, updates=2)
    assert loops.replicas == REPLICAS and loops.tf_keras.startswith("2.15.")
    for name in ("adam", "legacy momentum"):
        check_close(loops[name]["gradient_accumulator"], loops[name]["big_batch"], what=name)
        assert loops[name]["iterations"][0] == 2
