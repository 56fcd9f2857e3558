"""What a TensorFlow profiler trace of one update says: all-reduces and op time.

`profile(fn)` traces `fn()` (`tf.profiler.experimental`, host tracer level 2) and
returns the serialized `XSpace` of each `*.xplane.pb` it wrote (parsed with
`tensorflow.tsl.profiler.protobuf.xplane_pb2`). On host planes (`/host:...`) the
executor records one event per executed op kernel, named `<op name>:<op type>`, with
its duration; other events (`ExecutorState::Process`, `EagerExecute: ...`, a Python
function's name) are not op kernels and are left out. Device planes (GPU kernels)
are left out too, so an op is not counted twice; on GPUs the op time here is therefore
the host side of each op (its launch), not the kernel on the device.

**Op time by kernel category.** Of all op kernels of one update, the time of the
accumulation's own, by op type (first match wins):

* *accumulate*: `AssignAddVariableOp` (a buffer `+=` gradient, a micro-step counter
  `+= 1`; Keras 3 writes its own counters and metrics with `AssignVariableOp`, so the
  plain step runs none), and `AddV2` inside a `tf.while_loop` body (MicroBatching sums
  its gradients in loop tensors; its scalar loss sums and the last layer's bias add
  are in the loop too and counted with them);
* *assign*: `AssignVariableOp`: buffer resets (an assign of zeros), and also the step
  counters and metric totals every Keras step writes, so the plain step's share of
  this category is reported beside as what is not the accumulation's;
* *finiteness check*: `IsFinite`, `All`.

Shares are of the same trace's total op time, so the machine's load, which stretches
every kernel of a trace alike, mostly cancels; the tracer's own cost per event makes
small kernels look a little longer than they are (the shares err high).
"""

from __future__ import annotations

import glob
import re
import tempfile

import tensorflow as tf

from distgrad_course.lab.graph import ALL_REDUCE_OP_TYPES

CATEGORIES = ("accumulate", "assign", "finiteness check")
_BY_TYPE = {"AssignAddVariableOp": "accumulate", "AssignVariableOp": "assign",
            "IsFinite": "finiteness check", "All": "finiteness check"}
# A lowered `tf.while_loop` inlines its body under `<loop>/body/_<n>/`.
_LOOP_BODY = re.compile(r"/body/_\d+/")
_OP_TYPE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def op_events(xspace_bytes: bytes):
    """Yield `(op name, op type, duration in ps)` of every op kernel on host planes."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(xspace_bytes)
    for plane in space.planes:
        if not plane.name.startswith("/host:"):
            continue
        ops = {}
        for metadata_id, metadata in plane.event_metadata.items():
            name, sep, op_type = metadata.name.rpartition(":")
            # `CollectiveExecutor::RunClosure`, `EagerLocalExecute: SyncDevice`: not ops.
            if sep and name and not name.endswith(":") and " " not in metadata.name \
                    and _OP_TYPE.fullmatch(op_type):
                ops[metadata_id] = (name, op_type)
        for line in plane.lines:
            for event in line.events:
                op = ops.get(event.metadata_id)
                if op is not None:
                    yield op[0], op[1], event.duration_ps


def all_reduce_events(xspace_bytes: bytes) -> int:
    """Executed all-reduce kernels (all replicas) in a serialized `XSpace`."""
    return sum(op_type in ALL_REDUCE_OP_TYPES for _, op_type, _ in op_events(xspace_bytes))


def category(op_name: str, op_type: str) -> str | None:
    """The kernel category (`CATEGORIES`) of one op, or None: not the accumulation's."""
    if op_type == "AddV2" and _LOOP_BODY.search(op_name):
        return "accumulate"
    return _BY_TYPE.get(op_type)


def op_time(spaces: list[bytes], updates: int = 1) -> dict:
    """Op time of `updates` updates' traces, per update, by category.

    `{"total_us", "us": {category: µs}, "kernels": {category: count}, "percent":
    {category: share of total}}`. Raises ValueError if the traces hold no op kernel.
    """
    total, us, kernels = 0, dict.fromkeys(CATEGORIES, 0), dict.fromkeys(CATEGORIES, 0)
    for space in spaces:
        for name, op_type, duration in op_events(space):
            total += duration
            which = category(name, op_type)
            if which is not None:
                us[which] += duration
                kernels[which] += 1
    if not total:
        raise ValueError("the profiler trace holds no op kernel events.")
    return {"total_us": total / 1e6 / updates,
            "us": {c: us[c] / 1e6 / updates for c in CATEGORIES},
            "kernels": {c: kernels[c] / updates for c in CATEGORIES},
            "percent": {c: 100.0 * us[c] / total for c in CATEGORIES}}


def profile(fn) -> list[bytes]:
    """The serialized `XSpace`s of a profiler trace of `fn()`.

    Raises RuntimeError if the profiler wrote no trace.
    """
    with tempfile.TemporaryDirectory(prefix="distgrad-profile-") as logdir:
        options = tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=2, python_tracer_level=0, device_tracer_level=0)
        tf.profiler.experimental.start(logdir, options=options)
        try:
            fn()
        finally:
            tf.profiler.experimental.stop()
        files = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError(f"the profiler wrote no *.xplane.pb under {logdir}.")
        spaces = []
        for path in files:
            with open(path, "rb") as f:
                spaces.append(f.read())
    return spaces
