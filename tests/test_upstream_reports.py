"""The reproductions of docs/upstream.md: each still shows its defect on the installed
TensorFlow / Keras 3, and the page says so truthfully.

Every docs/upstream/NAME.py runs as `__main__` in a fresh Python (`distgrad_course.lab.child`,
target `upstream_runner:run_script`), with nothing but TensorFlow, Keras and NumPy; each
sets up its own two replicas. A multi-worker one (MULTI_WORKER) runs twice, as the two
workers of a local cluster (`distgrad_course.lab.local_cluster.run_workers` sets their
TF_CONFIG). A test asserts the defect's exact exception type and message fragment, or
the exact wrong numbers. Where the page says what tf-keras (Keras 2) does, the same
file runs under tf-keras too and must show that (no defect, or tf-keras' own). When upstream
fixes a defect its test fails: then update the page (and the course), not the test.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import importlib.metadata
import os
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from distgrad_course.lab.child import run_child
from distgrad_course.lab.local_cluster import run_workers

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "docs" / "upstream"
PAGE = ROOT / "docs" / "upstream.md"
MAX_LINES = 25
ALLOWED_IMPORTS = {"numpy", "tensorflow", "keras"}
INVALID_ARGUMENT = "tensorflow.python.framework.errors_impl.InvalidArgumentError"
UNFED = "You must feed a value for placeholder tensor"
MULTI_WORKER = {"multi_worker_fit"}  # run as 2 worker processes, one replica each
# Run with the variables `srun -n 2` sets for task 0 on one node (tests/test_slurm.py
# checks them on a real SLURM), and without GPUs.
SLURM_TASK = {"slurm_resolver_without_gpus": {
    "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
    "SLURM_STEP_TASKS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": ""}}


def _keras_adam_step(gradient_sum: float, sum_of_squares: float) -> float:
    """Row 0 after one Keras 3 `Adam(0.1)` step from zeros (`keras/src/optimizers/adam.py`,
    `update_step`), in float32 as Keras computes it: `m` gets the summed gradient, `v` the
    sum of the *squared rows* of the gradient it is given."""
    f = np.float32
    alpha = f(0.1) * np.sqrt(f(1) - f(0.999)) / (f(1) - f(0.9))
    m, v = f(gradient_sum) * f(1 - 0.9), f(sum_of_squares) * f(1 - 0.999)
    return float(-(m * alpha) / (np.sqrt(v) + f(1e-7)))


# Each replica's gradient of row 0 is -1: summed, -2. Dense, Adam squares the sum (4);
# as an IndexedSlices with indices [0, 0] it squares the rows and adds them (2).
ADAM_DENSE = _keras_adam_step(-2.0, 4.0)  # 0.1, up to epsilon
ADAM_SPARSE = _keras_adam_step(-2.0, 2.0)  # sqrt(2) times that


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a run must show: `values` (globals of the script, floats compared at float32
    precision, non-finite ones as the strings "inf"/"-inf"/"nan"), and the exception
    it raises (`error_type`, module-qualified, with every fragment in its message) or
    none (`error_type=None`)."""

    values: dict = dataclasses.field(default_factory=dict)
    error_type: str | None = None
    fragments: tuple[str, ...] = ()


# (file stem, keras module) -> what its run shows.
RUNS = {
    ("builtin_gradient_accumulation", "keras"): Expected(
        error_type="builtins.RuntimeError",
        fragments=("`merge_call` called while defining a new graph or a tf.function",
                   "Exception encountered when calling Cond.call()")),
    ("clip_before_all_reduce", "keras"): Expected({"one_device": 1.0, "two_replicas": 0.0}),
    ("clip_before_all_reduce", "tf_keras"): Expected({"one_device": 1.0, "two_replicas": 1.0}),
    ("loss_scale_first_replica_finite", "keras"): Expected(
        {"inf_on_replica_0": 1.0, "inf_on_replica_1": "-inf"}),
    ("adam_duplicate_indexed_slices", "keras"): Expected(
        {"dense": ADAM_DENSE, "sparse": ADAM_SPARSE}),
    ("adam_duplicate_indexed_slices", "tf_keras"): Expected(
        {"dense": ADAM_DENSE, "sparse": ADAM_DENSE}),
    ("lazy_slot_creation", "keras"): Expected(
        error_type=INVALID_ARGUMENT, fragments=(f"{UNFED} 'cond/", "fn_with_cond")),
    ("lazy_slot_creation", "tf_keras"): Expected(),
    ("steps_per_execution", "keras"): Expected(
        error_type=INVALID_ARGUMENT,
        fragments=(f"{UNFED} 'while/body/", "multi_step_on_iterator")),
    ("steps_per_execution", "tf_keras"): Expected(),
    ("cond_calls_function_with_collective", "keras"): Expected(
        {"inline_result": 2.0, "nested_result": 2.0, "in_loop_result": 2.0},
        error_type=INVALID_ARGUMENT,
        fragments=(f"{UNFED} 'cond/then/",)),
    ("loss_scale_not_saved", "keras"): Expected({"saved": 16384.0, "loaded": 16384.0}),
    ("loss_scale_not_saved", "tf_keras"): Expected({"saved": 16384.0, "loaded": 32768.0}),
    ("backup_and_restore_replays_epoch", "keras"): Expected(
        {"uninterrupted_updates": 16, "uninterrupted_w": 72.0,
         "resumed_updates": 22, "resumed_w": 93.0}),  # batches 0-5 of epoch 0 trained twice
    ("backup_and_restore_replays_epoch", "tf_keras"): Expected(
        {"uninterrupted_updates": 16, "uninterrupted_w": 72.0,
         "resumed_updates": 16, "resumed_w": 60.0}),  # steps 6, 7 trained on batches 0, 1
    ("multi_worker_fit", "keras"): Expected(
        error_type="builtins.ValueError",
        fragments=("Attempt to convert a value (PerReplica:{",
                   ("with an unsupported type (<class 'tensorflow.python.distribute.values."
                    "PerReplica'>) to a Tensor"))),
    ("slurm_resolver_without_gpus", "keras"): Expected(
        {"gpus_per_task": 0}, error_type="builtins.ValueError",
        fragments=("range() arg 3 must not be zero",)),
}


def _run(stem: str, keras_module: str) -> dict:
    names = sorted(RUNS[stem, keras_module].values)
    kwargs = {"path": str(UPSTREAM / f"{stem}.py"), "names": names, "keras_module": keras_module}
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")]),
           **SLURM_TASK.get(stem, {})}
    if stem not in MULTI_WORKER:
        return run_child("upstream_runner:run_script", kwargs, env=env, timeout=300).value
    outcomes = [worker.check().value for worker in run_workers(
        "upstream_runner:run_worker_script", 2, timeout=300, env=env, **kwargs)]
    assert outcomes[0] == outcomes[1], "the two workers disagree"
    return outcomes[0]


@pytest.fixture(scope="module")
def runs():
    """Every run of RUNS, three children at a time (each is mostly TensorFlow's import)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(_run, *key) for key in RUNS}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("key", list(RUNS), ids=[f"{s}-{k}" for s, k in RUNS])
def test_each_reproduction_shows_what_the_page_says(runs, key):
    expected, outcome = RUNS[key], runs[key]
    error = outcome["error"]
    if expected.error_type is None:
        assert error is None, f"{key} raised {error}"
    else:
        assert error is not None, f"{key} no longer raises {expected.error_type}: fixed upstream?"
        assert error["type"] == expected.error_type
        for fragment in expected.fragments:
            assert fragment in error["message"], error["message"][:2000]
    assert outcome["values"].keys() == expected.values.keys()
    for name, value in expected.values.items():
        if isinstance(value, str):
            assert outcome["values"][name] == value, name
        else:
            assert outcome["values"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def test_the_adam_numbers_differ_by_the_square_root_of_two():
    # What the page states about the sparse step, from the hand-computed Keras step.
    assert ADAM_DENSE == pytest.approx(0.1, rel=1e-5)
    assert ADAM_SPARSE / ADAM_DENSE == pytest.approx(np.sqrt(2), rel=1e-5)


# ------------------------------------------------------------------------- the files


def reproduction_files() -> list[Path]:
    return sorted(UPSTREAM.glob("*.py"))


def test_every_reproduction_file_is_run_here_and_only_those():
    assert {p.stem for p in reproduction_files()} == {stem for stem, _ in RUNS}


@pytest.mark.parametrize("path", reproduction_files(), ids=lambda p: p.stem)
def test_a_reproduction_is_short_stock_code_with_its_own_two_replicas(path):
    # Two devices of one process, or (MULTI_WORKER) two worker processes of a cluster.
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_LINES
    assert max(len(line) for line in source.splitlines()) <= 100
    tree = ast.parse(source)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS
    called = {node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    if path.stem in MULTI_WORKER:
        assert "MultiWorkerMirroredStrategy" in called and "TF_CONFIG" in source
    elif path.stem in SLURM_TASK:  # one task of a SLURM job step: SLURM's variables
        assert {"SlurmClusterResolver", "MultiWorkerMirroredStrategy"} <= called
        assert all(name in source for name in SLURM_TASK[path.stem] if name.startswith("SLURM"))
    else:
        assert {"set_logical_device_configuration", "MirroredStrategy"} <= called


# -------------------------------------------------------------------------- the page


def page_sections() -> dict[str, str]:
    """`{heading: body}` of the page's `## ` sections."""
    parts = re.split(r"^## (.+)$", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_page_includes_every_reproduction_once():
    text = PAGE.read_text(encoding="utf-8")
    included = re.findall(r'^--8<-- "upstream/([\w-]+)\.py"$', text, flags=re.MULTILINE)
    assert sorted(included) == [p.stem for p in reproduction_files()]


def section_of(stem: str) -> str:
    """The body of the one `## ` section of the page that includes upstream/STEM.py."""
    [body] = [b for b in page_sections().values() if f'--8<-- "upstream/{stem}.py"' in b]
    return body


def names_version(text: str, package: str, version: str) -> bool:
    """Whether `text` names `package` VERSION, or a range `package` LOW–HIGH that holds it
    (the page states the range the version matrix, docs/versions.md, ran it on)."""
    match = re.search(rf"(?<![\w-]){package} (\d[\d.]*)(?:–(\d[\d.]*))?", text)
    if not match:
        return False
    low, high = (tuple(int(n) for n in v.split(".")) for v in (match[1], match[2] or match[1]))
    return low <= tuple(int(n) for n in version.split(".")[:3]) <= high


@pytest.mark.parametrize("path", reproduction_files(), ids=lambda p: p.stem)
def test_each_section_names_the_versions_its_reproduction_ran_on_here(path):
    versions = {name: importlib.metadata.version(name)
                for name in ("tensorflow", "keras", "tf-keras")}
    body = section_of(path.stem)
    seen_on = re.search(r"^\*\*Seen on\*\*(.*)$", body, flags=re.MULTILINE)
    assert seen_on, f"the section of {path.name} has no '**Seen on**' line"
    assert names_version(seen_on[1], "TensorFlow", versions["tensorflow"]), seen_on[1]
    if "import keras" in path.read_text(encoding="utf-8"):
        assert names_version(seen_on[1], "Keras", versions["keras"]), seen_on[1]
    if (path.stem, "tf_keras") in RUNS:  # the page says what tf-keras does: name it
        assert names_version(seen_on[1], "tf-keras", versions["tf-keras"]), seen_on[1]


def test_a_version_range_holds_the_versions_between_its_ends():
    line = "TensorFlow 2.16.2–2.21.0, Keras 3.15.1; tf-keras 2.16.0–2.21.0"
    assert names_version(line, "TensorFlow", "2.18.1")
    assert not names_version(line, "TensorFlow", "2.15.1")
    assert names_version(line, "Keras", "3.15.1") and not names_version(line, "Keras", "3.14.0")
    assert names_version(line, "tf-keras", "2.21.0")
    assert not names_version(line, "tf-keras", "2.22.0")


def test_the_page_is_in_the_nav_and_its_scripts_are_not_published():
    config = yaml.safe_load(
        re.sub(r"!!python/\S+", "null", (ROOT / "mkdocs.yml").read_text(encoding="utf-8")))
    assert "upstream.md" in str(config["nav"])
    assert "/upstream/" in config["exclude_docs"].split()
