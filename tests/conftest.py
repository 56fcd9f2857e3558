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
        gc.collect()
        gc.freeze()  # TensorFlow's and Keras' objects: no collection scans them again


def _strategy(replicas):
    from distgrad_course import make_strategy

    return make_strategy(replicas)


@pytest.fixture(autouse=True)
def collect_garbage_after_long_tests():
    """`gc.collect()` after every test that ran 1 s or more, so that the `tf.data`
    iterators it left in reference cycles are freed while they are young.

    Freeing an iterator joins its autotuning thread (`Model::OptimizeLoop`), with the GIL
    held. That thread sleeps between optimizations for a period that doubles from 10 ms
    up to 60 s; when it misses the cancellation (a race in TensorFlow 2.21: 3 of 8 frees
    of an 8 s old iterator in `benchmarks/iterator_free.py`) it sleeps out the rest of
    its period first, and every thread of the process waits (measured there with
    TensorFlow alone). A `fit` that raised leaves its iterator in a cycle (Keras' epoch
    iterator and its suspended generator), freed by whichever later cyclic GC runs: in
    `make test` that made tests of 3-4 s take 20-45 s. Quick tests, which run no `fit`,
    skip the collection. After it, `gc.freeze()` (as after TensorFlow's import, and as the
    fork server does) moves what survived out of the collector's sight, so each
    collection scans only what the tests since allocated, not the whole heap: four spec
    files in one process took 108.3 s instead of 128.6 s, at the same peak memory (py-spy
    had put 8 % of their CPU in this fixture's collections)."""
    start = time.perf_counter()
    yield
    if time.perf_counter() - start >= 1.0:
        gc.collect()
        gc.freeze()


@pytest.fixture
def collect_garbage():
    """`gc.collect()` after a quick test in which `fit` raises (see above). The lab's
    `backup.one_fit` frees a `fit` it stops by itself (`backup.free_stopped_fit`)."""
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


@pytest.fixture(params=[1, 2], ids=["R1", "R2"])
def no_merge_call(request):
    """TensorFlow's no-merge-call path (XLA on GPUs) on CPUs: the no-merge-call specs of
    AccumulatingOptimizer, GradientAccumulator and MicroBatching run on it."""
    from distgrad_course.lab.xla_path import no_merge_call_strategy

    return no_merge_call_strategy(request.param)
