"""Object storage (gs://, s3://) emulated on a local directory, killed at any of its writes.

On GCS and S3, as `tf.io.gfile` reaches them, a rename is a copy followed by a delete, and
only the write of one object is atomic. TensorFlow 2.21's GCS file system has its endpoints
built in, so a local GCS emulator cannot stand in for it; this emulation can.
`ObjectStore(root, kill_at)`, entered, patches `tf.io.gfile` in this process:

* `rename` becomes `copy`, then `remove` of the source;
* every mutating operation on a path under `root` is logged as `[batch, operation, name]`
  (`name` relative to `root`): `copy`, `remove`, `rmtree`, `makedirs`, `mkdir`, `write` (a
  `GFile` opened to write or append), `rename:copy` and `rename:remove` (a rename's two
  halves). `batch` counts the `fit` batches begun so far (`store.callback()`, in `fit`'s
  callbacks): a backup taken after batch b logs b.
* `kill_at=(batch, index)`: the process ends with `os._exit(KILLED)` instead of doing the
  `index`-th (from 0) operation logged at `batch`. Each operation is whole or not done, as
  one object's write is on object storage.

`fit_in_child` and `fit_on_worker` run `distgrad_course.lab.backup.one_fit` under it in a child
process (`distgrad_course.lab.child`) or on each worker of a local cluster; `run_cluster` starts
such a cluster and ends every worker once one of them is killed.
"""

from __future__ import annotations

import dataclasses
import os
import time

KILLED = 75  # the exit status of a process killed by the emulation
MUTATING = ("copy", "remove", "rmtree", "makedirs", "mkdir")


class ObjectStore:
    def __init__(self, root: str, kill_at=None):
        self.root = os.path.abspath(root)
        self.kill_at = None if kill_at is None else tuple(kill_at)
        self.log: list[list] = []
        self.batch = 0
        self._originals = {}

    def _op(self, operation: str, path) -> None:
        path = os.path.abspath(os.fspath(path))
        if path != self.root and not path.startswith(self.root + os.sep):
            return
        index = sum(1 for batch, _, _ in self.log if batch == self.batch)
        if self.kill_at == (self.batch, index):
            os._exit(KILLED)  # a kill: nothing after it runs, no file is closed
        self.log.append([self.batch, operation, os.path.relpath(path, self.root)])

    def __enter__(self):
        import tensorflow as tf

        gfile = tf.io.gfile
        self._originals = {name: getattr(gfile, name) for name in (*MUTATING, "rename", "GFile")}
        real = self._originals

        def mutating(name):
            def operation(path, *args, **kwargs):
                self._op(name, args[0] if name == "copy" else path)  # copy: its target
                return real[name](path, *args, **kwargs)
            return operation

        def rename(source, target, overwrite=False):
            self._op("rename:copy", target)
            real["copy"](source, target, overwrite=overwrite)
            self._op("rename:remove", source)
            real["remove"](source)

        def open_file(name, mode="r"):
            if "w" in mode or "a" in mode:
                self._op("write", name)
            return real["GFile"](name, mode)

        for name in MUTATING:
            setattr(gfile, name, mutating(name))
        gfile.rename, gfile.GFile = rename, open_file
        return self

    def __exit__(self, *exc_info):
        import tensorflow as tf

        for name, function in self._originals.items():
            setattr(tf.io.gfile, name, function)

    def callback(self):
        import keras

        store = self

        class CountBatches(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                store.batch += 1

        return CountBatches()


def fit_under(strategy, backup_dir: str, kill_at=None, **options) -> dict:
    """`one_fit` under `ObjectStore(backup_dir, kill_at)`: its result and the log."""
    from distgrad_course.lab.backup import one_fit

    with ObjectStore(backup_dir, kill_at) as store:
        result = one_fit(strategy, backup_dir, extra=[store.callback()], **options)
    return {"result": dataclasses.asdict(result), "log": store.log}


def fit_in_child(backup_dir: str, replicas: int = 2, kill_at=None, **options) -> dict:
    """Child target: `fit_under` on `make_strategy(replicas)`; `replicas=0`: no strategy
    (TensorFlow's default one: one device)."""
    import tensorflow as tf

    from distgrad_course.devices import make_strategy

    strategy = make_strategy(replicas) if replicas else tf.distribute.get_strategy()
    return fit_under(strategy, backup_dir, kill_at, **options)


def fit_on_worker(task_index: int, num_workers: int, backup_dir: str, kill_at=None,
                  collective_timeout: float = 60.0, **options) -> dict:
    """Worker target (`run_cluster`): `fit_under` with `MultiWorkerFitModel` on
    `MultiWorkerMirroredStrategy`; every worker logs, only the chief (task 0) writes."""
    from distgrad_course.lab.local_cluster import make_worker_strategy

    strategy = make_worker_strategy(collective_timeout)
    return fit_under(strategy, backup_dir, kill_at, multi_worker=True, **options)


def run_cluster(num_workers: int = 2, timeout: float = 240.0, **kwargs) -> list:
    """`fit_on_worker(**kwargs)` on every worker of a local cluster, as
    `distgrad_course.lab.local_cluster.run_workers` runs it, except that once a worker is killed
    (exit status `KILLED`) the others are killed too, as a preempted cluster would be,
    instead of waiting out their collective timeout. One `ChildResult` per worker."""
    from distgrad_course.lab.child import Child
    from distgrad_course.lab.local_cluster import (
        free_ports,
        tf_config,
        visible_gpus,
        worker_devices,
    )

    target = "distgrad_course.lab.object_store:fit_on_worker"
    ports, gpus = free_ports(num_workers), visible_gpus()
    workers = []
    try:
        for index in range(num_workers):
            workers.append(Child(
                target, {"task_index": index, "num_workers": num_workers, **kwargs},
                env={**worker_devices(index, num_workers, gpus),
                     "TF_CONFIG": tf_config(ports, index)}))
        deadline = time.monotonic() + timeout
        while not all(w.poll() for w in workers):
            if any(w.poll() and w.process.returncode == KILLED for w in workers):
                break  # the others are killed below
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not finish within {timeout:.0f} s")
            time.sleep(0.05)
        return [w.result() for w in workers]
    finally:
        for w in workers:
            w.result()  # kills a worker still running
