"""`BackupAndRestore`'s `SIGTERM`: every worker backs up after the same batch, then the
process exits with `PREEMPTED_EXIT_CODE`.

    watch = SigtermWatch(cluster_of(strategy) if multi_worker else None)  # at fit start:
                                    # installs the handler (Python allows the main thread only)
    if watch.due(trained_batches):  # at the end of every trained batch
        ...                         # back up
        watch.exit("...")           # restores the handler; sys.exit(PREEMPTED_EXIT_CODE)
    watch.close()                   # at fit's end: restores the handler

The handler only records the signal. Python runs it between bytecodes, so after the
TensorFlow call of the batch then running returns: that batch is finished, then backed up.

On several workers (`MultiWorkerMirroredStrategy`) every step all-reduces, so no worker is
more than one trained batch ahead of another. The worker that got the signal, at the end of
its batch n, publishes n + 1 in the coordination service's key-value store, as
`tf.distribute.experimental.PreemptionCheckpointHandler` does
(`tensorflow/python/distribute/failure_handling/failure_handling.py`). Every worker's
watcher thread, blocked on that key since fit started, reads it and acknowledges; the
signalled worker waits for every acknowledgement before its batch n + 1, so no worker can
finish that batch without knowing. Per batch this costs a look at a flag
(`benchmarks/sigterm_cost.py`).

A handler installed before, any Python function (yours; `PreemptionCheckpointHandler`
installs one of its own), is chained: called right after this one records the signal.
The default action and `SIG_IGN` have nothing to call. A signal recorded but never acted
on (it came during the last batch of a multi-worker fit, or while a restart was skipping
batches to the end) is passed on when fit ends: the handler before is restored, and, if it
is the default action, the signal raised again (a Python handler was called already).

This file imports only TensorFlow and the standard library: copy it with `backup_and_restore.py`.
"""

from __future__ import annotations

import itertools
import signal
import sys
import threading
import zlib

import tensorflow as tf

PREEMPTED_EXIT_CODE = 42  # tf.distribute's exit code to restart on (failure_handling_util)
ACK_TIMEOUT_MS = 60_000  # how long the signalled worker waits for the others to acknowledge
_STOP = "stop"  # the key's value when fit ends with no SIGTERM: the watchers return
_fits = itertools.count()  # multi-worker fits in this process: the same on every worker


def is_multi_worker(strategy) -> bool:
    """A `MultiWorkerMirroredStrategy` of 2+ workers (`_in_multi_worker_mode`: private)."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def same_on_every_worker(strategy, key: str) -> bool:
    """Whether every worker of `strategy` passed the same `key`: one all-reduce of a
    20-bit hash h and h * h (equal iff R * sum(h^2) == sum(h)^2; float64 sums exact)."""
    mark = float(zlib.crc32(key.encode()) % (1 << 20) + 1)
    local = tf.constant([mark, mark * mark], tf.float64)
    total, squares = strategy.reduce("SUM", strategy.run(lambda: tf.identity(local)),
                                     axis=None).numpy()
    return strategy.num_replicas_in_sync * squares == total * total


def cluster_of(strategy) -> tuple[str, list[str]]:
    """(this worker's id, every worker's id) of a multi-worker strategy."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec()
    ids = [f"{job}_{index}" for job in ("chief", "worker") if job in spec.jobs
           for index in range(spec.num_tasks(job))]
    return f"{resolver.task_type}_{resolver.task_id}", ids


class SigtermWatch:
    """The `SIGTERM` handler of one `fit`. `cluster`: None on one worker, else what
    `cluster_of` returns."""

    def __init__(self, cluster=None):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "BackupAndRestore(handle_sigterm=True) installs a SIGTERM handler, which "
                "Python allows only in the main thread; this fit runs in thread "
                f"{threading.current_thread().name!r}. Pass handle_sigterm=False (a SIGTERM "
                "then ends the process without a backup), or call fit in the main thread.")
        previous = signal.getsignal(signal.SIGTERM)
        while isinstance(getattr(previous, "__self__", None), SigtermWatch):
            previous = previous.__self__.previous  # left by a fit that raised: unwrap it
        self.previous = previous
        self.signalled = False
        self._acted = False
        self._agreed = None  # the batch every worker backs up after, once known
        self._published = False
        self._cluster, self._watcher = cluster, None
        if cluster is not None:
            self._key = f"distgrad_BackupAndRestore_sigterm_{next(_fits)}"
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name="BackupAndRestore-sigterm")
            self._watcher.start()
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.signalled = True
        if callable(self.previous):
            self.previous(signum, frame)

    def _watch(self):
        """Watcher thread: wait for the agreed batch; acknowledge it."""
        value = _kv().get_config_key_value(self._key)
        if value == _STOP:
            return
        self._agreed = int(value)
        _kv().set_config_key_value(f"{self._key}_ack_{self._cluster[0]}", "1")

    def due(self, trained: int) -> bool:
        """At the end of trained batch number `trained` (counted from 1 in this fit):
        whether to back up now and exit."""
        if self._cluster is None:
            return self.signalled
        if self.signalled and not self._published:
            self._published = True
            self._publish(trained + 1)
        return self._agreed is not None and trained >= self._agreed

    def _publish(self, batch: int) -> None:
        kv = _kv()
        try:
            kv.set_config_key_value(self._key, str(batch))
        except tf.errors.AlreadyExistsError:
            return  # another worker was signalled first: its batch holds
        for worker in self._cluster[1]:  # every watcher has read it (this one's too)
            try:
                kv.get_config_key_value(f"{self._key}_ack_{worker}", ACK_TIMEOUT_MS)
            except tf.errors.OpError as error:
                sys.stderr.write(f"BackupAndRestore: worker {worker} did not acknowledge the "
                                 f"SIGTERM batch ({type(error).__name__}); going on.\n")

    def exit(self, message: str):
        """Restore the handler before, and exit with `PREEMPTED_EXIT_CODE`."""
        self._acted = True
        self._restore()
        sys.stderr.write(f"BackupAndRestore: SIGTERM: {message}; exiting with status "
                         f"{PREEMPTED_EXIT_CODE}.\n")
        sys.stderr.flush()
        sys.exit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        """At fit's end: stop the watcher, restore the handler before, pass on a signal
        that was not acted on."""
        if self._watcher is not None:
            try:
                _kv().set_config_key_value(self._key, _STOP)
            except tf.errors.OpError:
                pass  # a batch was published (or a peer already stopped it)
            self._watcher.join(timeout=10)
        self._restore()
        if self.signalled and not self._acted and not callable(self.previous):
            signal.raise_signal(signal.SIGTERM)

    def _restore(self) -> None:
        if signal.getsignal(signal.SIGTERM) == self._handle:
            previous = signal.SIG_DFL if self.previous is None else self.previous  # (set in C)
            signal.signal(signal.SIGTERM, previous)


def _kv():
    from tensorflow.python.eager import context  # the key-value store: no public API

    return context.context()
