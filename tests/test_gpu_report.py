"""tests/gpu_report.py: the page `make gpu-check` writes from its JUnit files and results."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import gpu_report

LESSONS = """<testsuites><testsuite name="pytest">
<testcase classname="docs.lessons" name="01_where_gradients_sync.ipynb" time="30"/>
<testcase classname="docs.lessons" name="03_cond_and_merge_call.ipynb" time="40">
<failure message="AssertionError: max abs diff 3e-06 | rtol 1e-06&#10;second line"/>
</testcase></testsuite></testsuites>"""


def test_the_report_lists_each_run_its_outcome_and_what_was_measured(tmp_path):
    (tmp_path / "lessons.xml").write_text(LESSONS)
    (tmp_path / "results.json").write_text(json.dumps({
        "environment": {"tensorflow": "2.21.0", "physical_gpus": ["/physical_device:GPU:0"]},
        "all_reduces_per_update": [{"graph_sizes": [49, 1], "nccl_kernels": {}}]}))
    page = gpu_report.report(tmp_path)
    assert "## Lessons: 1 of 2 passed" in page
    assert ("| 03_cond_and_merge_call.ipynb | failed | AssertionError: max abs diff 3e-06 "
            "\\| rtol 1e-06 |") in page
    assert "| tensorflow | 2.21.0 |" in page
    assert "## GPU-only checks: 0 of 1 passed" in page  # checks.xml was never written
    assert "| checks.xml | missing |" in page
    assert "| graph_sizes | nccl_kernels |" in page and "| [49, 1] | {} |" in page


def test_without_results_the_report_says_the_checks_never_reached_a_gpu(tmp_path):
    assert "the checks did not reach a GPU" in gpu_report.report(tmp_path)
