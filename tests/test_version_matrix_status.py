"""The status of each upstream report, as the version matrix (src/course/distgrad_course/
matrix_tables.py) derives it from the per-test results of tests/test_upstream_reports.py
(no TensorFlow: the driver's own logic), and the driver run by path as `make matrix` runs it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from distgrad_course import matrix_results, matrix_tables
from distgrad_course import version_matrix as matrix

RUN = "test_each_reproduction_shows_what_the_page_says[lazy_slot_creation-{}]"
GONE = ("AssertionError: ('lazy_slot_creation', 'keras') no longer raises tensorflow.python."
        "framework.errors_impl.InvalidArgumentError: fixed upstream? … assert None is not None")
REWORDED = ("AssertionError: merge_call called … assert 'Exception encountered when calling "
            "Cond.call()' in 'merge_call called'")


def cell(tf: str, keras: str, keras_run: str = "pass", message: str = "") -> dict:
    tests = {RUN.format("keras"): {"status": keras_run} | ({"message": message} if message
                                                            else {}),
             RUN.format("tf_keras"): {"status": "pass"}}
    return {"date": "2026-12-04", "versions": {"tensorflow": tf, "keras": keras,
                                               "tf_keras": tf, "python": "3.11.7"},
            "upstream": {"tests": tests}}


def row(results: dict) -> str:
    [line] = [line for line in matrix_tables.status_table(results).splitlines()
              if "(#lazy-slot-creation)" in line]
    return line


def test_a_defect_seen_on_the_newest_release_and_the_nightly_reproduces():
    line = row({"tf2.21": cell("2.21.0", "3.15.1"), "nightly": cell("2.23.0.dev1", "3.16.0.dev1")})
    assert "| reproduces | tf2.21, nightly | — |" in line


def test_a_defect_whose_exception_is_gone_on_the_nightly_is_fixed_there():
    line = row({"tf2.21": cell("2.21.0", "3.15.1"),
                "nightly": cell("2.23.0.dev1", "3.16.0.dev1", "failure", GONE)})
    assert "fixed in nightly (Keras 3 run: no longer raises `InvalidArgumentError`)" in line
    assert line.endswith("| tf2.21 | nightly |")


def test_another_message_or_an_error_is_a_change_not_a_fix():
    line = row({"tf2.21": cell("2.21.0", "3.15.1"),
                "nightly": cell("2.23.0.dev1", "3.16.0.dev1", "failure", REWORDED)})
    assert "changed in nightly (Keras 3 run: the same exception, without `Exception " in line
    line = row({"tf2.21": cell("2.21.0", "3.15.1"),
                "nightly": cell("2.23.0.dev1", "3.16.0.dev1", "error", "ImportError: no")})
    assert "changed in nightly (Keras 3 run: `ImportError: no`)" in line


def test_a_release_that_fails_after_one_that_passes_fixed_it():
    line = row({"tf2.20": cell("2.20.0", "3.15.1"),
                "tf2.21": cell("2.21.0", "3.16.0", "failure", GONE),
                "nightly": cell("2.23.0.dev1", "3.16.0.dev1", "failure", GONE)})
    assert "fixed in release tf2.21 (Keras 3 run: no longer raises" in line
    assert line.endswith("| tf2.20 | tf2.21, nightly |")


def test_cells_without_per_test_results_are_not_recorded_rather_than_passed():
    old = {"date": "2026-12-03", "versions": {"tensorflow": "2.16.2", "keras": "3.15.1"},
           "tests": {matrix_results.UPSTREAM_TESTS: {"status": "pass"}}}
    assert "| not recorded on a release | — | — |" in row({"tf2.16": old})
    both = {"tf2.16": old, "tf2.21": cell("2.21.0", "3.15.1")}
    assert "| reproduces (nightly: not recorded) | tf2.21 | — |" in row(both)
    assert "* Not recorded per report: tf2.16 " in matrix_tables.status_table(both)


def test_the_page_test_is_no_report_run():
    assert not matrix_results.DEFECT_TEST.match(
        "test_each_section_names_the_versions_its_reproduction_ran_on_here[lazy_slot_creation]")
    run = matrix_results.DEFECT_TEST.match(RUN.format("tf_keras"))
    assert run.groups() == ("lazy_slot_creation", "tf_keras")


def test_the_keras_2_cell_is_tensorflow_2_15_and_the_keras_3_bound_is_read_from_pyproject():
    keras2 = [c for c in matrix.cells() if c.get("keras2")]
    assert [c["name"] for c in keras2] == ["tf2.15"] and keras2[0]["tf"] == "2.15"
    assert matrix.keras_lower_bound() == "3.10"  # pyproject.toml excludes 3.0.* ... 3.9.*
    assert "tf2.16-keras3.10" in [c["name"] for c in matrix.cells()]


def test_a_cell_recorded_per_test_gets_one_row_per_test_with_its_failure():
    record = {"selection": "test_legacy", "per_test": {
        "test_legacy.py::test_a": {"status": "pass"},
        "test_legacy.py::test_b[x|y]": {"status": "failure", "message": "AssertionError: 1 | 2"},
        "test_version_checks.py::test_c": {"status": "skipped", "message": "Keras 3 process"}}}
    rows = matrix_tables.per_test_table({"tf2.16": {}, "tf2.15": record})
    assert rows[1] == ("Per test, cell tf2.15 (`pytest -k test_legacy` on its test files): "
                       "1 failure, 1 pass, 1 skipped.")
    assert rows[3:] == ["| test | tf2.15 |", "|---|---|",
                        "| `test_legacy.py::test_a` | ✓ |",
                        "| `test_legacy.py::test_b[x/y]` | failure: `AssertionError: 1 / 2` |",
                        "| `test_version_checks.py::test_c` | skipped: `Keras 3 process` |"]


def test_the_driver_run_by_path_loads_its_modules_from_its_own_folder(tmp_path):
    """`make matrix` runs the file with the system python, outside the package: `-I` (no
    PYTHONPATH, no script folder on sys.path) from another folder still finds its modules."""
    driver = Path(matrix.__file__)
    done = subprocess.run([sys.executable, "-I", str(driver), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "--tables" in done.stdout
