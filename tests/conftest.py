"""Shared fixtures. The test process gets 2 logical CPU devices before TensorFlow
initializes, so one process serves 1- and 2-replica tests; tests that need a fresh
runtime (other device counts, call-order errors) use `run_python` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import distgrad  # noqa: E402
from distgrad.devices import replica_devices  # noqa: E402

MAX_REPLICAS = 2
replica_devices(MAX_REPLICAS)


@pytest.fixture(scope="session")
def strategy2():
    return distgrad.make_strategy(2)


@pytest.fixture(scope="session")
def strategy1():
    return distgrad.make_strategy(1)


@pytest.fixture(params=[1, 2], ids=["R1", "R2"])
def strategy(request):
    return distgrad.make_strategy(request.param)


def run_python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python (fresh TensorFlow runtime); returns the completed process."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )
