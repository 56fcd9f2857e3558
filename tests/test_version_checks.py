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
MODULES = ("optimizer", "accumulator", "train_step", "mixed_precision")
REFUSED = r"needs TensorFlow >= 2\.16 and Keras >= 3\.10, found .*: pip install -U 'tensorflow>=2\.16' 'keras>=3\.10'"  # noqa: E501


def declared_lower_bounds() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    return {name: tuple(int(n) for n in re.search(rf'"{name}>=([\d.]+)"', text)[1].split("."))
            for name in ("tensorflow", "keras")}


@pytest.mark.parametrize("name", MODULES)
def test_each_reference_file_needs_what_pyproject_declares(name):
    assert importlib.import_module(f"distgrad.{name}").NEEDED == declared_lower_bounds()


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("package, version", [(keras, "3.9.2"), (keras, "2.15.0"),
                                              (tf, "2.15.1")])
def test_an_older_tensorflow_or_keras_is_refused_naming_the_fix(monkeypatch, name, package,
                                                                version):
    module = importlib.import_module(f"distgrad.{name}")
    monkeypatch.setattr(package, "__version__", version)
    with pytest.raises(ImportError, match=f"distgrad.{name} {REFUSED}"):
        module._check_versions()


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("tf_version, keras_version", [("2.16.0", "3.10.0"),
                                                       ("2.22.0rc0", "3.16.0.dev2026")])
def test_the_oldest_declared_versions_and_newer_ones_pass(monkeypatch, name, tf_version,
                                                          keras_version):
    module = importlib.import_module(f"distgrad.{name}")
    monkeypatch.setattr(tf, "__version__", tf_version)
    monkeypatch.setattr(keras, "__version__", keras_version)
    module._check_versions()


@pytest.mark.parametrize("name", MODULES)
def test_a_copied_file_checks_at_import(monkeypatch, name):
    monkeypatch.setattr(keras, "__version__", "3.3.0")
    with pytest.raises(ImportError, match=REFUSED):  # raised before any class is defined
        runpy.run_path(str(ROOT / "src" / "distgrad" / f"{name}.py"))
