"""The files of a `BackupAndRestore` backup, committed so that a kill at any moment leaves a
whole backup behind: on a local disk, and on object storage (gs://, s3://), where a rename
is a copy followed by a delete and only the write of one object is atomic.

    store = BackupStore("gs://bucket/run-1", keep_previous=False)
    metadata = store.load(model)  # the newest whole backup's metadata (weights loaded), or None
    store.save(model, metadata, write=is_chief)  # every worker: save_weights is a collective

The commit protocol (the anchors: `tf.train.CheckpointManager`'s `checkpoint` index file,
Orbax's commit marker):

1. The weights go to a file of a new name, `ckpt-<generation>.weights.h5`:
   `model.save_weights` writes a local temporary file (Keras writes with h5py, which knows
   only local files), copied into the directory with `tf.io.gfile.copy`.
2. The commit point: the manifest `training_metadata.json`, one small JSON object that
   names that file and its size, with the backup's metadata (epoch, batch, position in the
   data). It is written as `training_metadata.json.tmp`, then renamed over the manifest: a
   local rename is atomic; an object store's rename copies one object (atomic) and then
   deletes the temporary one, so a kill between the two leaves only a stray `.tmp`.
3. Only then are the files the manifest no longer names deleted.

A restore reads the manifest and only the file it names. A backup killed before its commit
left at most a file no manifest names, overwritten by the next backup of that generation.
With `keep_previous` (`double_checkpoint`) the manifest also names the generation before,
kept until the next commit: when the newest file is missing, of another size than recorded
(a torn upload) or unreadable, the restore warns and falls back to it. Without, it raises.

Every worker reads the backup; only the writer (`write=True`, the chief) touches the
directory. The others write their `save_weights` (reading replica-local variables is a
collective every worker must join) to a local temporary directory and delete it. Every
operation on the directory goes through `tf.io.gfile`, as gs:// needs (and a test's
emulation of object storage sees).

Older layouts restore as before and are replaced by the next commit: distgrad 0.2's
(`latest.weights.h5`, `training_metadata.json` of format "distgrad.BackupAndRestore/1",
`pending.*` files of an interrupted commit) and `keras.callbacks.BackupAndRestore`'s (the
same two files, `{"epoch", "batch"}` only). Their commit does not hold on object storage.

This file imports only TensorFlow and the standard library: copy it with `callbacks.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings

import tensorflow as tf

FORMAT = "distgrad.BackupAndRestore/2"
LEGACY_FORMAT = "distgrad.BackupAndRestore/1"  # distgrad 0.2
MANIFEST = "training_metadata.json"  # the name keras.callbacks.BackupAndRestore uses
MANIFEST_TEMP = MANIFEST + ".tmp"
# distgrad 0.2's layout (Keras' own: the first file and MANIFEST): deleted by the next commit
LEGACY_WEIGHTS = "latest.weights.h5"
LEGACY_PENDING_WEIGHTS = "pending.weights.h5"
LEGACY_PENDING_METADATA = "pending_metadata.json"
LEGACY_FILES = (LEGACY_WEIGHTS, LEGACY_PENDING_WEIGHTS, LEGACY_PENDING_METADATA,
                LEGACY_WEIGHTS + ".bkp", MANIFEST + ".bkp")


def weights_name(generation: int) -> str:
    return f"ckpt-{generation}.weights.h5"


@contextlib.contextmanager
def _local_copy(path: str):
    """`path` itself if it is local, else a local temporary copy (h5py reads local files)."""
    if "://" not in path:
        yield path
        return
    directory = tempfile.mkdtemp(prefix="distgrad-backup-")
    try:
        local = os.path.join(directory, os.path.basename(path))
        tf.io.gfile.copy(path, local, overwrite=True)
        yield local
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class BackupStore:
    """The backup in `directory`: `load` the newest whole one, `save` and commit a new one,
    `delete` them all. `keep_previous`: the manifest also names the generation before."""

    def __init__(self, directory: str, keep_previous: bool = False):
        self.directory = directory
        self.keep_previous = keep_previous
        self._named = []  # the records the manifest names, the one to keep first
        self._next_generation = 1
        self._legacy = False  # an older layout was restored: its files go at the next commit
        self._made = False

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _read_json(self, name: str):
        path = self._path(name)
        if not tf.io.gfile.exists(path):
            return None
        with tf.io.gfile.GFile(path) as file:
            text = file.read()
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"BackupAndRestore: {path} is not JSON ({error}). Delete "
                             f"{self.directory} to start over.") from None

    # -- reading ------------------------------------------------------------------------

    def load(self, model) -> dict | None:
        """Load the newest whole backup into `model` (built, its optimizer built); return
        its metadata, or None if there is no backup. Call it in the strategy's scope."""
        manifest = self._read_json(MANIFEST)
        if manifest is None or manifest.get("format") != FORMAT:
            return self._load_legacy(model, manifest)
        records = [{k: v for k, v in manifest.items() if k != "previous"}]
        if manifest.get("previous"):
            records.append(manifest["previous"])
        self._next_generation = max(r["generation"] for r in records) + 1
        for index, record in enumerate(records):
            problem = self._load_generation(model, record)
            if problem is None:
                self._named = [record] + [r for r in records if r is not record]
                return record
            if index + 1 < len(records):
                warnings.warn(f"BackupAndRestore: {problem}: restoring the backup before it, "
                              f"{records[index + 1]['weights']}.", UserWarning, stacklevel=3)
        fallback = ("" if len(records) > 1 else
                    " No backup before it is kept (double_checkpoint=True keeps one).")
        raise ValueError(f"BackupAndRestore: {problem}.{fallback} Delete {self.directory} "
                         "to start over.")

    def _load_generation(self, model, record: dict) -> str | None:
        """Load one generation's weights; what is wrong with its file, or None."""
        path = self._path(record["weights"])
        if not tf.io.gfile.exists(path):
            return f"{path} is missing"
        size = tf.io.gfile.stat(path).length
        if size != record["weights_bytes"]:
            return (f"{path} has {size} bytes, not the {record['weights_bytes']} its manifest "
                    "recorded (a torn write)")
        try:
            with _local_copy(path) as local:
                model.load_weights(local)
        except OSError as error:  # h5py: a damaged file
            return f"{path} cannot be read ({error})"
        return None

    def _load_legacy(self, model, metadata: dict | None) -> dict | None:
        """distgrad 0.2's or Keras' layout, loaded as distgrad 0.2 did."""
        weights = self._path(LEGACY_WEIGHTS)
        if not tf.io.gfile.exists(weights):
            return None
        if (tf.io.gfile.exists(self._path(LEGACY_PENDING_METADATA))
                and not tf.io.gfile.exists(self._path(LEGACY_PENDING_WEIGHTS))):
            metadata = self._read_json(LEGACY_PENDING_METADATA)  # killed between its renames
        if metadata is None:
            raise ValueError(f"BackupAndRestore: {weights} has no {MANIFEST} beside it. "
                             f"Delete {self.directory} to start over.")
        with _local_copy(weights) as local:
            model.load_weights(local)
        self._legacy = True
        return metadata

    # -- writing ------------------------------------------------------------------------

    def save(self, model, metadata: dict, write: bool = True) -> None:
        """`model.save_weights` into a local temporary file (every worker must: it reads
        replica-local variables); with `write`, commit it as the next generation."""
        local_dir = tempfile.mkdtemp(prefix="distgrad-backup-")
        try:
            local = os.path.join(local_dir, "backup.weights.h5")
            model.save_weights(local)
            if not write:
                return
            if not self._made:
                tf.io.gfile.makedirs(self.directory)
                self._made = True
            generation = self._next_generation
            record = {**metadata, "format": FORMAT, "generation": generation,
                      "weights": weights_name(generation),
                      "weights_bytes": os.path.getsize(local)}
            tf.io.gfile.copy(local, self._path(record["weights"]), overwrite=True)  # 1.
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        named = [record] + self._named[:1] if self.keep_previous else [record]
        manifest = dict(record, **({"previous": named[1]} if len(named) > 1 else {}))
        with tf.io.gfile.GFile(self._path(MANIFEST_TEMP), "w") as file:  # 2.
            file.write(json.dumps(manifest))
        tf.io.gfile.rename(self._path(MANIFEST_TEMP), self._path(MANIFEST), overwrite=True)
        self._next_generation = generation + 1
        kept = {r["weights"] for r in named}  # 3.
        retired = [r["weights"] for r in self._named if r["weights"] not in kept]
        retired += list(LEGACY_FILES) if self._legacy else []
        self._named, self._legacy = named, False
        for name in retired:
            if tf.io.gfile.exists(self._path(name)):
                tf.io.gfile.remove(self._path(name))

    def delete(self) -> None:
        """Delete the backup: the manifest first (a kill midway leaves no backup, not a
        manifest naming deleted files), then the directory."""
        if tf.io.gfile.exists(self._path(MANIFEST)):
            tf.io.gfile.remove(self._path(MANIFEST))
        if tf.io.gfile.exists(self.directory):
            tf.io.gfile.rmtree(self.directory)
