"""Shared fixtures. The test process gets 2 logical CPU devices before TensorFlow
initializes, so one process serves 1- and 2-replica tests; tests that need a fresh
runtime (other device counts, call-order errors) call a function of a real module in a
child (`distgrad.lab.child.run_child`; test-only targets are in `workers_for_tests`)."""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CPU allocator statistics (the memory tests) exist only with oneDNN on; TensorFlow turns
# it on by itself only on CPUs with AVX-512 (or newer), so say it for every machine.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import distgrad  # noqa: E402
from distgrad.devices import replica_devices  # noqa: E402

MAX_REPLICAS = 2
replica_devices(MAX_REPLICAS)


@pytest.fixture
def collect_garbage():
    """For a test in which `fit` raises. The traceback holds the fit's tf.data iterator in
    reference cycles until the cyclic GC frees it, which can be several tests later. An
    iterator freed long after it stopped was measured to block the freeing thread, with
    the GIL held, for 10-90 s (a tf.data background thread has to end first). Freed
    right after the test, it went at once in every run measured."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def strategy2():
    return distgrad.make_strategy(2)


@pytest.fixture(scope="session")
def strategy1():
    return distgrad.make_strategy(1)


@pytest.fixture(params=[1, 2], ids=["R1", "R2"])
def strategy(request):
    return distgrad.make_strategy(request.param)
