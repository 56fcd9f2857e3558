"""Each reference file refuses, at import, a TensorFlow or Keras older than the oldest the
version matrix passes (docs/versions.md): an ImportError naming the fix, not a failure deep
inside Keras. The bounds are pyproject.toml's."""

import importlib
import pathlib
import re
import runpy

import keras
import pytest
import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = ("optimizer", "accumulator", "train_step", "mixed_precision", "multi_worker")
FIX = "pip install -U 'tensorflow>=2.16' 'keras>=3.10'"


def declared_lower_bounds() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    return {name: tuple(int(n) for n in re.search(rf'"{name}>=([\d.]+)"', text)[1].split("."))
            for name in ("tensorflow", "keras")}


def import_copy(monkeypatch, name, tf_version, keras_version):
    """Run src/distgrad/NAME.py as a copied file would be imported, under these versions
    (its Keras registrations left out, so the real classes stay registered)."""
    monkeypatch.setattr(tf, "__version__", tf_version)
    monkeypatch.setattr(keras, "__version__", keras_version)
    monkeypatch.setattr(keras.saving, "register_keras_serializable",
                        lambda **_: lambda cls: cls)
    return runpy.run_path(str(ROOT / "src" / "distgrad" / f"{name}.py"))


@pytest.mark.parametrize("name", MODULES)
def test_each_reference_file_needs_what_pyproject_declares(name):
    assert importlib.import_module(f"distgrad.{name}").NEEDED == declared_lower_bounds()


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("tf_version, keras_version", [
    ("2.21.0", "3.9.2"), ("2.21.0", "3.3.0"), ("2.15.1", "2.15.0"), ("2.15.1", "3.15.1")])
def test_an_older_tensorflow_or_keras_is_refused_at_import_naming_the_fix(
        monkeypatch, name, tf_version, keras_version):
    with pytest.raises(ImportError) as refused:
        import_copy(monkeypatch, name, tf_version, keras_version)
    assert str(refused.value) == (
        f"distgrad.{name} needs TensorFlow >= 2.16 and Keras >= 3.10, found TensorFlow "
        f"{tf_version} and Keras {keras_version}: {FIX}")


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("tf_version, keras_version", [
    ("2.16.0", "3.10.0"), ("2.16.0rc0", "3.10.0rc1"), ("2.22.0", "3.16.0.dev2026")])
def test_the_oldest_declared_versions_and_newer_ones_import(monkeypatch, name, tf_version,
                                                            keras_version):
    assert import_copy(monkeypatch, name, tf_version, keras_version)["NEEDED"]
