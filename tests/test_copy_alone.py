"""The reference classes can be copied alone into a project, and train correctly there."""

import ast
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "distgrad"
REFERENCE_FILES = ("optimizer.py", "accumulator.py", "train_step.py", "mixed_precision.py",
                   "non_finite.py", "callbacks.py", "backup_and_restore.py", "clipping.py",
                   "normalization.py", "sparse.py", "multi_worker.py", "tf_keras/optimizer.py")
ALLOWED = set(sys.stdlib_module_names) | {"tensorflow", "keras", "numpy", "__future__"}
# The files that carry a generated copy of what they use of non_finite.py.
NON_FINITE_USERS = ["accumulator.py", "mixed_precision.py", "optimizer.py", "train_step.py"]


def test_every_library_file_is_a_reference_file_or_a_package_init():
    library = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    assert library - set(REFERENCE_FILES) == {"__init__.py", "tf_keras/__init__.py"}


@pytest.mark.parametrize("name", REFERENCE_FILES)
def test_reference_module_imports_only_tensorflow_keras_numpy_and_the_stdlib(name):
    """Each file copies alone: no import of distgrad or of another file beside it."""
    tree = ast.parse((SRC / name).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name} has a relative import"
            roots.add(node.module.split(".")[0])
    assert roots <= ALLOWED, f"{name} imports {sorted(roots - ALLOWED)}"


def test_backup_and_restore_copied_alone_backs_up_without_distgrad(tmp_path, monkeypatch):
    """backup_and_restore.py copied alone into a project without distgrad: a fit's backup
    is written by the copy, no warning."""
    import warnings

    import keras
    import numpy as np

    shutil.copy(SRC / "backup_and_restore.py", tmp_path / "backup_and_restore.py")
    for module in ("distgrad", "distgrad.backup_and_restore"):  # as if distgrad were not
        monkeypatch.setitem(sys.modules, module, None)  # installed
    monkeypatch.delitem(sys.modules, "backup_and_restore", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = keras.saving.get_custom_objects()  # the copy registers its own model class
    saved = dict(registry)
    copied = importlib.import_module("backup_and_restore")
    registry.clear()
    registry.update(saved)  # later tests load distgrad's own ResumableFitModel
    assert copied.__file__ == str(tmp_path / "backup_and_restore.py")
    inputs = keras.Input((2,))
    model = copied.ResumableFitModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x = np.arange(32, dtype="float32").reshape(16, 2) / 16
    backup_dir = tmp_path / "backup"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, x.sum(axis=1), batch_size=4, verbose=0, shuffle=False, callbacks=[
            copied.BackupAndRestore(str(backup_dir), save_freq=2, delete_checkpoint=False)])
    manifest = json.loads((backup_dir / "training_metadata.json").read_text())
    assert (manifest["weights"], manifest["batches_done"]) == ("ckpt-2.weights.h5", 4)
    assert manifest["global_batch"] == 4
    assert sorted(os.listdir(backup_dir)) == [  # one device: the iterator's state too
        "ckpt-2.iterator", "ckpt-2.weights.h5", "training_metadata.json"]


def test_copied_files_train_under_mirrored_strategy_equal_to_big_batch(tmp_path):
    for name in ("optimizer.py", "accumulator.py", "train_step.py"):  # each alone
        shutil.copy(SRC / name, tmp_path / name)
    done = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).with_name("copied_project.py")),
         str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(ratios) == {"AccumulatingOptimizer", "GradientAccumulator", "MicroBatching"}
    for name, ratio in ratios.items():  # allclose(rtol=1e-6, atol=1e-6) <=> ratio <= 1
        assert ratio <= 1.0, f"{name} differs from big batch: allclose ratio {ratio:.3f}"


def test_the_copied_tf_keras_file_trains_under_tf_keras_equal_to_big_batch(tmp_path):
    from distgrad_course.lab.compare import check_close
    from distgrad_course.lab.data import regression_data
    from distgrad_course.lab.tf_keras_runner import run_tf_keras

    shutil.copy(SRC / "tf_keras" / "optimizer.py", tmp_path / "optimizer.py")
    x, y = regression_data(32)
    path = f"{tmp_path}{os.pathsep}{pathlib.Path(__file__).parent}"
    runs = run_tf_keras("tf_keras_children:fit_equivalence", 2, env={"PYTHONPATH": path},
                      x=x.tolist(), y=y.tolist(), micro_batch=8, accumulation_steps=2,
                      names=["adam"], module="optimizer")  # the copy, not distgrad.tf_keras
    check_close(runs["adam"]["accumulated"], runs["adam"]["big_batch"])
    assert (runs["adam"]["optimizer"], runs["adam"]["module"]) == ("AccumulatingOptimizer",
                                                                   "optimizer")


def test_the_base_install_is_the_reference_package_only(tmp_path):
    """`pip install .` installs tensorflow, keras, numpy and the `distgrad` package: its
    wheel holds the reference classes, none of the course (`distgrad_course`, src/course)."""
    import zipfile

    import tomllib

    root = SRC.parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert names == {"tensorflow", "keras", "numpy"}
    assert set(project["optional-dependencies"]) == {"docs", "test", "legacy", "bench"}
    clone = tmp_path / "clone"  # the tracked files: a stale build/lib would go in the wheel
    shutil.copytree(SRC, clone / "src" / "distgrad",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", *(p.name for p in root.glob("LICENSE*"))):
        shutil.copy(root / name, clone / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(tmp_path), str(clone)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel, = tmp_path.glob("distgrad-*.whl")
    modules = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    expected = {f"distgrad/{p.relative_to(SRC)}" for p in SRC.rglob("*.py")}
    assert modules == expected
    assert not any("lab" in m or "pitfalls" in m or "devices" in m for m in modules)


def test_the_non_finite_policy_is_defined_once_and_each_copy_is_generated_from_it(tmp_path):
    """non_finite.py is the one definition; the files that use it carry a generated copy
    (`make copies`), which must match it. A change there that was not copied is caught."""
    from distgrad_course import copies

    assert copies.files_with_copies() == NON_FINITE_USERS
    assert copies.stale_copies() == []
    library = tmp_path / "distgrad"
    shutil.copytree(SRC, library, ignore=shutil.ignore_patterns("__pycache__"))
    policy = library / "non_finite.py"
    policy.write_text(policy.read_text().replace('("raise", "skip")', '("raise", "skip", "zero")'))
    assert copies.stale_copies(library) == ["accumulator.py", "optimizer.py", "train_step.py"]
    stale = library / "optimizer.py"
    stale.write_text(copies.regenerate(stale.read_text(), policy.read_text()))
    assert '"zero")' in stale.read_text()
    assert copies.stale_copies(library) == ["accumulator.py", "train_step.py"]
