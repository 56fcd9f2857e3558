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
REFERENCE_FILES = ("optimizer.py", "optimizer_checks.py", "inner_update.py",
                   "keras_loss_scale.py", "accumulator.py", "train_step.py", "mixed_precision.py",
                   "non_finite.py", "callbacks.py", "backup_and_restore.py", "backup_commit.py",
                   "fit_data.py", "preemption.py", "clipping.py", "normalization.py", "sparse.py",
                   "multi_worker.py", "tf_keras/optimizer.py", "tf_keras/tf_keras_checks.py",
                   "tf_keras/tf_keras_state.py")
ALLOWED = set(sys.stdlib_module_names) | {"tensorflow", "keras", "numpy", "__future__"}
# A reference file copied together with another: it imports `distgrad.<module>`, or, copied
# (no distgrad installed), `<module>` beside it. Its docstring says so.
BACKUP_FILES = ("backup_and_restore", "backup_commit", "fit_data", "preemption")
# The non-finite policy is defined once, in non_finite.py, copied with each class that uses it.
NON_FINITE_USERS = ("optimizer.py", "accumulator.py", "train_step.py", "mixed_precision.py",
                    "optimizer_checks.py", "inner_update.py")
# AccumulatingOptimizer's files: what it refuses, the update a cycle makes, Keras' own
# LossScaleOptimizer around it; tf-keras: what it refuses, what it saves (from tf_keras/).
OPTIMIZER_FILES = ("optimizer_checks", "inner_update", "keras_loss_scale")
TF_KERAS_FILES = ("tf_keras_checks", "tf_keras_state")
COPIED_WITH = {"backup_and_restore.py": BACKUP_FILES[1:],
               **{name: ("non_finite",) for name in NON_FINITE_USERS},
               "optimizer.py": ("non_finite", *OPTIMIZER_FILES),
               "tf_keras/optimizer.py": TF_KERAS_FILES}


@pytest.mark.parametrize("name", REFERENCE_FILES)
def test_reference_module_imports_only_tensorflow_keras_numpy_and_the_stdlib(name):
    tree = ast.parse((SRC / name).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name} has a relative import"
            roots.add(node.module.split(".")[0])
            if name in COPIED_WITH and node.module.startswith("distgrad"):
                package = node.module in ("distgrad", "distgrad.tf_keras")
                companions = {alias.name for alias in node.names} if package \
                    else {node.module.rsplit(".", 1)[-1]}  # or distgrad[.tf_keras].<file>
                assert companions <= set(COPIED_WITH[name]), node.module
    companions = COPIED_WITH.get(name, ())
    allowed = ALLOWED | ({"distgrad", *companions} if companions else set())
    assert roots <= allowed, f"{name} imports {sorted(roots - ALLOWED)}"
    for companion in companions:
        assert f"`{companion}.py`" in ast.get_docstring(tree)


def test_backup_and_restore_copied_with_its_companions_backs_up_without_distgrad(
        tmp_path, monkeypatch):
    """backup_and_restore.py, backup_commit.py, fit_data.py and preemption.py copied into a
    project without distgrad: a fit's backup is written by the copy, no warning."""
    import warnings

    import keras
    import numpy as np

    for name in BACKUP_FILES:
        shutil.copy(SRC / f"{name}.py", tmp_path / f"{name}.py")
    for module in ("distgrad", *(f"distgrad.{name}" for name in BACKUP_FILES)):  # as if
        monkeypatch.setitem(sys.modules, module, None)  # distgrad were not installed
    for module in BACKUP_FILES:
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = keras.saving.get_custom_objects()  # the copy registers its own model class
    saved = dict(registry)
    copied = importlib.import_module("backup_and_restore")
    fit_data = importlib.import_module("fit_data")
    registry.clear()
    registry.update(saved)  # later tests load distgrad's own ResumableFitModel
    assert [copied.backup_commit.__name__, copied.fit_data.__name__,
            copied.preemption.__name__] == ["backup_commit", "fit_data", "preemption"]
    inputs = keras.Input((2,))
    model = fit_data.ResumableFitModel(inputs, keras.layers.Dense(1)(inputs))
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
    for name in ("optimizer.py", "accumulator.py", "train_step.py", "non_finite.py",
                 *(f"{companion}.py" for companion in OPTIMIZER_FILES)):
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
    from distgrad_course.lab.legacy import run_legacy

    for name in ("optimizer", *TF_KERAS_FILES):
        shutil.copy(SRC / "tf_keras" / f"{name}.py", tmp_path / f"{name}.py")
    x, y = regression_data(32)
    path = f"{tmp_path}{os.pathsep}{pathlib.Path(__file__).parent}"
    runs = run_legacy("tf_keras_children:fit_equivalence", 2, env={"PYTHONPATH": path},
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
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(tmp_path), str(root)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel, = tmp_path.glob("distgrad-*.whl")
    modules = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    expected = {f"distgrad/{p.relative_to(SRC)}" for p in SRC.rglob("*.py")}
    assert modules == expected
    assert not any("lab" in m or "pitfalls" in m or "devices" in m for m in modules)
