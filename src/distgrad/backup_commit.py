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

A generation may have attachments beside its weights, copied in step 1 as
`ckpt-<generation>.<key>` and named by the manifest: `BackupAndRestore` attaches the state
of `fit`'s data iterator where TensorFlow can save it (one device, no strategy).

A restore reads the manifest and only the file it names. A backup killed before its commit
left at most a file no manifest names, overwritten by the next backup of that generation.
With `keep_previous` (`double_checkpoint`) the manifest also names the generation before,
kept until the next commit: when the newest file is missing, of another size than recorded
(a torn upload) or unreadable, the restore warns and falls back to it. Without, it raises.

Every worker reads the backup; only the writer (`write=True`, the chief) touches the
directory, every operation through `tf.io.gfile` (as gs:// needs). The others save into a
local temporary directory (reading replica-local variables is a collective).

Older layouts restore as before and are replaced by the next commit: distgrad 0.2's
(`latest.weights.h5`, `training_metadata.json` of format "distgrad.BackupAndRestore/1",
`pending.*` files of an interrupted commit) and `keras.callbacks.BackupAndRestore`'s (the
same two files, `{"epoch", "batch"}` only). Their commit does not hold on object storage.

The manifest also records the run's identity (`run_identity`), which `load(model,
identity)` checks before loading any weights (`check_identity`).

This file imports only TensorFlow and the standard library: copy it with
`backup_and_restore.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
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


# What identifies a run, recorded in every manifest and compared at restore.
IDENTITY_FIELDS = ("run_id", "accumulation_steps", "optimizer", "optimizer_variables",
                   "global_batch", "replicas", "workers")
# May differ at a restart with the same global batch: replica-local sums are restored as
# SUM / R (`SyncOnReadVariable.assign`), so the next update all-reduces the same totals.
TOPOLOGY_FIELDS = ("replicas", "workers")


def weights_name(generation: int) -> str:
    return f"ckpt-{generation}.weights.h5"


def _optimizer_chain(optimizer) -> list:
    """`optimizer` and those it wraps (`inner_optimizer`, recursively), outermost first."""
    chain = []
    while optimizer is not None:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def _variable_layout(model, optimizer) -> list:
    """[name, shape] of each of the optimizer's (built) variables. A slot's name begins with
    its model variable's path, which holds per-process layer counters (`dense_4`): that
    prefix becomes the variable's index, `<weight 2>`, the same in every process."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", f"<weight {i}>_")
                       for i, v in enumerate(model.trainable_variables)),
                      key=lambda pair: -len(pair[0]))
    layout = []
    for variable in optimizer.variables:
        name = variable.name
        for prefix, short in prefixes:
            if name.startswith(prefix):
                name = short + name[len(prefix):]
                break
        layout.append([name, [int(d) for d in variable.shape]])
    return layout


def run_identity(model, replicas: int, workers: int, run_id=None, global_batch=None) -> dict:
    """What identifies the run of `model` (compiled, its optimizer built). `run_id`: the
    user's, else `SLURM_JOB_ID` from the environment, else None (`check_identity` then
    adopts the backup's, or a new uuid). `global_batch`: None where unknown."""
    if run_id is None:
        run_id = os.environ.get("SLURM_JOB_ID") or None
    chain = _optimizer_chain(model.optimizer)
    steps = next((o.accumulation_steps for o in chain if hasattr(o, "accumulation_steps")),
                 getattr(model, "accumulation_steps", None))
    return {"run_id": None if run_id is None else str(run_id),
            "accumulation_steps": None if steps is None else int(steps),
            "global_batch": None if global_batch is None else int(global_batch),
            "replicas": int(replicas), "workers": int(workers),
            "optimizer": " > ".join(type(o).__name__ for o in chain),
            "optimizer_variables": (_variable_layout(model, model.optimizer)
                                    if model.optimizer is not None else [])}


def _layout_difference(recorded: list, now: list) -> str:
    if len(recorded) != len(now):
        return f"{len(recorded)} variables (recorded) vs {len(now)} now"
    first = next(i for i, (a, b) in enumerate(zip(recorded, now)) if a != b)
    return f"variable {first} is {recorded[first]} (recorded) vs {now[first]} now"


def check_identity(recorded: dict, identity: dict, directory: str) -> dict:
    """`identity` with its run id filled in (the recorded one, or a new uuid when there is
    no backup or it recorded none); raises `ValueError` naming every field of `recorded`
    that differs. Fields `recorded` lacks (an older backup) are not compared, nor a global
    batch unknown on either side; replicas and workers may differ with the same global batch."""
    identity = dict(identity)
    if identity["run_id"] is None:
        identity["run_id"] = (recorded or {}).get("run_id") or uuid.uuid4().hex
    recorded = recorded or {}
    batch, batch_now = recorded.get("global_batch"), identity["global_batch"]
    same_batch = batch is not None and batch == batch_now
    differences = []
    for field in IDENTITY_FIELDS:
        if field not in recorded or recorded[field] == identity[field]:
            continue
        if field == "global_batch" and batch_now is None or field in TOPOLOGY_FIELDS and same_batch:
            continue
        if field == "optimizer_variables":
            what = _layout_difference(recorded[field], identity[field])
        else:
            what = f"{recorded[field]!r} (recorded) vs {identity[field]!r} now"
        if field in TOPOLOGY_FIELDS:
            what += (f", and the global batch is {batch!r} (recorded) vs {batch_now!r} now: "
                     "another worker or replica count resumes exactly only with the same "
                     "global batch, known on both sides (give BackupAndRestore fit's "
                     "arguments: distgrad.ResumableFitModel)")
        differences.append(f"{field}: {what}")
    if differences:
        raise ValueError(
            f"BackupAndRestore: the backup in {directory} belongs to another run or setup: "
            + "; ".join(differences) + ". To resume it, run with the recorded setup (and "
            "run id: BackupAndRestore(run_id=...) or SLURM_JOB_ID). To start over, pass a "
            f"new backup_dir, or delete {directory}.")
    return identity


def _files(record: dict) -> list:
    """The files of one generation: its weights and its attachments."""
    return [record["weights"], *(a["name"] for a in record.get("attachments", {}).values())]


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
        self.identity = {}  # recorded in every manifest: `load(model, identity)` sets it

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

    def load(self, model, identity: dict | None = None, agree=None) -> dict | None:
        """Load the newest whole backup into `model` (built, its optimizer built); return
        its metadata, or None if there is no backup. Call it in the strategy's scope.
        `identity` (`run_identity`): checked against the backup's before any weights are
        loaded (`check_identity`); `self.identity` is then what the next backups record.
        `agree(manifest)`: called before any weights are loaded (loading is a collective
        on several workers), with the manifest read (None if there is none)."""
        manifest = self._read_json(MANIFEST)
        if identity is not None:
            current = manifest is not None and manifest.get("format") == FORMAT
            self.identity = check_identity(manifest if current else None,  # older layouts
                                           identity, self.directory)  # record none
        if agree is not None:
            agree(manifest)
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

    def save(self, model, metadata: dict, write: bool = True, attachments=None) -> None:
        """`model.save_weights` into a local temporary file (every worker must: it reads
        replica-local variables); with `write`, commit it as the next generation, with
        `attachments` ({key: a local file}, e.g. the data iterator's state) beside it."""
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
            record = {**metadata, **self.identity, "format": FORMAT, "generation": generation,
                      "weights": weights_name(generation),
                      "weights_bytes": os.path.getsize(local), "attachments": {}}
            tf.io.gfile.copy(local, self._path(record["weights"]), overwrite=True)  # 1.
            for key, path in (attachments or {}).items():
                name = f"ckpt-{generation}.{key}"
                record["attachments"][key] = {"name": name, "bytes": os.path.getsize(path)}
                tf.io.gfile.copy(path, self._path(name), overwrite=True)
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        named = [record] + self._named[:1] if self.keep_previous else [record]
        manifest = dict(record, **({"previous": named[1]} if len(named) > 1 else {}))
        with tf.io.gfile.GFile(self._path(MANIFEST_TEMP), "w") as file:  # 2.
            file.write(json.dumps(manifest))
        tf.io.gfile.rename(self._path(MANIFEST_TEMP), self._path(MANIFEST), overwrite=True)
        self._next_generation = generation + 1
        kept = {name for r in named for name in _files(r)}  # 3.
        retired = [name for r in self._named for name in _files(r) if name not in kept]
        retired += list(LEGACY_FILES) if self._legacy else []
        self._named, self._legacy = named, False
        for name in retired:
            if tf.io.gfile.exists(self._path(name)):
                tf.io.gfile.remove(self._path(name))

    @contextlib.contextmanager
    def attachment(self, record: dict, key: str):
        """A local copy of `record`'s attachment `key` (None if it has none); `ValueError`
        if its file is missing or of another size than recorded (a torn write)."""
        entry = record.get("attachments", {}).get(key)
        if entry is None:
            yield None
            return
        path = self._path(entry["name"])
        if not tf.io.gfile.exists(path) or tf.io.gfile.stat(path).length != entry["bytes"]:
            raise ValueError(f"{path} is missing or not the {entry['bytes']} bytes its "
                             "manifest recorded")
        with _local_copy(path) as local:
            yield local

    def delete(self) -> None:
        """Delete the backup: the manifest first (a kill midway leaves no backup, not a
        manifest naming deleted files), then the directory."""
        if tf.io.gfile.exists(self._path(MANIFEST)):
            tf.io.gfile.remove(self._path(MANIFEST))
        if tf.io.gfile.exists(self.directory):
            tf.io.gfile.rmtree(self.directory)
