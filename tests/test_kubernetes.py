"""docs/cluster/: the Kubernetes manifests against the Kubernetes API schemas (offline, with
kubernetes-validate), and their entrypoint, which builds TF_CONFIG, run as 2 local workers.
The cluster itself (DNS, a preempted pod, the JobSet controller's restart) cannot run here."""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from distgrad_course.lab.local_cluster import free_ports

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "docs" / "cluster"
ENTRYPOINT = CLUSTER / "tf_config_entrypoint.sh"
STAND_IN = Path(__file__).with_name("cluster_stand_in.py")
# podFailurePolicy is stable from Kubernetes 1.31; kubernetes-validate's newest schemas too.
VERSIONS = ["1.31.0", kubernetes_validate.latest_version()]


def load(name):
    return {d["kind"]: d for d in yaml.safe_load_all((CLUSTER / name).read_text())}


def pod_env(pod_spec):
    (container,) = pod_spec["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def run_entrypoint(env, *args, timeout=30):
    env = {"PATH": os.environ["PATH"], "PYTHON": sys.executable,
           "TRAIN_SCRIPT": str(STAND_IN), **env}
    return subprocess.run(["sh", str(ENTRYPOINT), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_resource_of_the_manifest_validates(version):
    for resource in load("kubernetes.yaml").values():
        kubernetes_validate.validate(resource, version, strict=True)


def test_the_validation_rejects_a_misspelt_field():
    job = copy.deepcopy(load("kubernetes.yaml")["Job"])
    job["spec"]["completionsMode"] = job["spec"].pop("completionMode")
    with pytest.raises(kubernetes_validate.ValidationError, match="completionsMode"):
        kubernetes_validate.validate(job, VERSIONS[-1], strict=True)


def test_the_job_service_and_entrypoint_agree():
    resources = load("kubernetes.yaml")
    service, job = resources["Service"], resources["Job"]["spec"]
    pod = job["template"]["spec"]
    env = pod_env(pod)
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= job["template"]["metadata"]["labels"].items()
    assert pod["subdomain"] == service["metadata"]["name"] == env["SUBDOMAIN"]
    assert job["completionMode"] == "Indexed"
    assert int(env["WORKERS"]) == job["completions"] == job["parallelism"]
    (container,) = pod["containers"]
    assert (int(env["TF_PORT"]) == container["ports"][0]["containerPort"]
            == service["spec"]["ports"][0]["port"])
    assert container["command"] == ["/opt/distgrad/docs/cluster/tf_config_entrypoint.sh"]
    # Any failed pod fails the Job: a replacement pod alone cannot rejoin the cluster.
    assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == resources["PersistentVolumeClaim"]["metadata"]["name"]
    assert resources["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_jobset_runs_the_same_job_and_restarts_on_preemption():
    plain, jobset = load("kubernetes.yaml"), load("jobset.yaml")
    spec = jobset["JobSet"]["spec"]
    (replicated,) = spec["replicatedJobs"]
    assert replicated["template"]["spec"] == plain["Job"]["spec"]
    assert jobset["PersistentVolumeClaim"] == plain["PersistentVolumeClaim"]
    assert spec["network"]["subdomain"] == plain["Service"]["metadata"]["name"]
    assert spec["failurePolicy"]["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    # No schema of the JobSet kind is bundled: its Job is validated as a Job.
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "workers"},
           "spec": replicated["template"]["spec"]}
    kubernetes_validate.validate(job, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("manifest, hostname", [
    ("kubernetes.yaml", "{job}-{index}"),          # an Indexed Job's pod: <job>-<index>
    ("jobset.yaml", "{job}-workers-0-{index}"),    # <jobset>-<replicated job>-<job index>-<index>
])
def test_the_entrypoint_names_every_worker_by_its_stable_hostname(manifest, hostname):
    resources = load(manifest)
    job = resources.get("Job") or resources["JobSet"]
    spec = job["spec"]["replicatedJobs"][0]["template"]["spec"] if manifest == "jobset.yaml" \
        else job["spec"]
    env = pod_env(spec["template"]["spec"])
    names = [hostname.format(job=job["metadata"]["name"], index=i)
             for i in range(spec["completions"])]
    for index, name in enumerate(names):
        result = run_entrypoint({**env, "HOSTNAME": name, "JOB_COMPLETION_INDEX": str(index)},
                                "--print-config", "--backup-dir", "/backups/x")
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout)
        assert seen["tf_config"] == {
            "cluster": {"worker": [f"{n}.distgrad-workers:2222" for n in names]},
            "task": {"type": "worker", "index": index}}
        assert seen["argv"] == ["--print-config", "--backup-dir", "/backups/x"]


def test_the_entrypoint_keeps_a_tf_config_set_by_tfjob_or_vertex_ai():
    theirs = json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:2"]},
                         "task": {"type": "worker", "index": 0}})
    result = run_entrypoint({"TF_CONFIG": theirs}, "--print-config")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tf_config"] == json.loads(theirs)


@pytest.mark.parametrize("env, message", [
    ({"HOSTNAME": "web-7", "JOB_COMPLETION_INDEX": "1", "WORKERS": "2", "SUBDOMAIN": "s"},
     "the hostname 'web-7' does not end in -1"),
    ({"HOSTNAME": "t-1", "JOB_COMPLETION_INDEX": "1", "SUBDOMAIN": "s"}, "set WORKERS"),
    ({"HOSTNAME": "t-1", "JOB_COMPLETION_INDEX": "1", "WORKERS": "2"}, "set SUBDOMAIN"),
    ({"HOSTNAME": "t-2", "JOB_COMPLETION_INDEX": "2", "WORKERS": "2", "SUBDOMAIN": "s"},
     "JOB_COMPLETION_INDEX=2, but there are 2 workers"),
    ({"JOB_COMPLETION_INDEX": "0", "WORKERS": "3", "WORKER_ADDRESSES": "a:1,b:2"},
     "WORKERS=3, but WORKER_ADDRESSES names 2 workers"),
    ({"WORKER_ADDRESSES": "a:1,b:2"}, "set JOB_COMPLETION_INDEX"),
])
def test_the_entrypoint_refuses_what_it_cannot_turn_into_a_cluster(env, message):
    result = run_entrypoint(env, "--print-config")
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stdout == ""  # train.py never started


def test_two_workers_started_by_the_entrypoint_form_one_cluster():
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    workers = [subprocess.Popen(
        ["sh", str(ENTRYPOINT), "--backup-dir", "/tmp/unused"],
        env={**os.environ, "PYTHON": sys.executable, "TRAIN_SCRIPT": str(STAND_IN),
             "JOB_COMPLETION_INDEX": str(index), "WORKER_ADDRESSES": ",".join(addresses),
             "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for index in range(2)]
    try:
        deadline = time.monotonic() + 240
        outputs = [w.communicate(timeout=max(1.0, deadline - time.monotonic()))
                   for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait()
    for index, (worker, (out, err)) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, err[-3000:]
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen == {"cluster": {"worker": addresses}, "task": ["worker", index],
                        "replicas": 2, "sum": 3.0, "argv": ["--backup-dir", "/tmp/unused"]}
