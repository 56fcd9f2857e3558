"""Shared fixtures. The test process gets 2 logical CPU devices before TensorFlow
initializes, so one process serves 1- and 2-replica tests; tests that need a fresh
runtime (other device counts, call-order errors) call a function of a real module in a
child (`distgrad_course.lab.child.run_child`; test-only targets are in `workers_for_tests`)."""

from __future__ import annotations

import gc
import os
import time

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CPU allocator statistics (the memory tests) exist only with oneDNN on; TensorFlow turns
# it on by itself only on CPUs with AVX-512 (or newer), so say it for every machine.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

MAX_REPLICAS = 2


def pytest_configure(config):
    # The pytest-xdist controller runs no test: importing TensorFlow there held up the
    # start of the workers by 5 s and the end of the session by 1-2 s (measured).
    if hasattr(config, "workerinput") or config.getoption("dist", "no") == "no":
        from distgrad_course.devices import replica_devices

        replica_devices(MAX_REPLICAS)


def _strategy(replicas):
    from distgrad_course import make_strategy

    return make_strategy(replicas)


@pytest.fixture(autouse=True)
def collect_garbage_after_long_tests():
    """`collect_garbage` (below) after every test that ran 1 s or more: the stalls of
    10-90 s it prevents hit whichever later test the cyclic GC happens to run in, which
    `make test`'s slowest tests showed (tests of 3-4 s alone took 20-45 s in the suite).
    A full collection costs about 0.13 s with TensorFlow loaded, so quick tests, which
    run no `fit`, skip it."""
    start = time.perf_counter()
    yield
    if time.perf_counter() - start >= 1.0:
        gc.collect()


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
    return _strategy(2)


@pytest.fixture(scope="session")
def strategy1():
    return _strategy(1)


@pytest.fixture(params=[1, 2], ids=["R1", "R2"])
def strategy(request):
    return _strategy(request.param)
