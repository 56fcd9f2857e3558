"""Measurements on runners: paired interleaved timing, all-reduce counts, memory.

Timing. A shared machine's load changes from second to second, so the runners of one
group are timed *round-robin*: in each round every runner trains one block (the same
number of micro-batches for all), in an order rotated by one each round, and each
approach's time is divided by its path's baseline time *of the same round*. The
median and the spread (min, max, quartiles) of those paired ratios are reported.
Python's garbage collector is paused inside a timed block. The process' CPU time of each
block is recorded too, and compared the same way.

All-reduces, three ways, for one accumulated update (k micro-batches):

* **graph**: `distgrad.pitfalls.mask_trick.all_reduce_placement` /
  `fit_step_placement` on each traced function: all-reduces that run on every call, and
  those inside a `tf.cond` branch (run only when it is taken);
* **derived**: graph counts x how often each ran: calls counted by the runner (fit's
  `on_train_batch_end`, loop iterations), cond-branch runs from the wrapped optimizer's
  `iterations` (updates actually made);
* **measured**: executed all-reduce kernels in a TensorFlow profiler trace
  (`tf.profiler.experimental`, host tracer level 2, `*.xplane.pb` parsed with
  `tensorflow.tsl.profiler.protobuf.xplane_pb2`): events named `<op name>:<op type>`
  with an all-reduce op type, divided by the replica count. A count that is not a
  multiple of the replica count is an incomplete trace and is retaken (`all_reduce_record`).
"""

from __future__ import annotations

import gc
import glob
import statistics
import tempfile
import time

import tensorflow as tf

from distgrad.lab.graph import ALL_REDUCE_OP_TYPES
from distgrad.memory import allocator_device, measure_step_memory


def summary(values) -> dict:
    """median, min, max and quartiles of `values` (at least one)."""
    values = sorted(float(v) for v in values)
    if not values:
        raise ValueError("summary of no values.")
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "min": values[0], "max": values[-1],
            "q1": q1, "q3": q3, "n": len(values)}


def timed_rounds(runners: list, updates_of, repeats: int) -> tuple[dict, dict]:
    """`({key: [wall seconds per round]}, {key: [process CPU seconds per round]})`.

    Round-robin with a rotating order; `updates_of(runner)` is the number of updates of
    one block for that runner. The CPU time (`time.process_time`, all threads of this
    process) is a second view that other processes' load disturbs less than wall time:
    it counts the work done, not the time waited for a core.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    wall = {r.key: [] for r in runners}
    cpu = {r.key: [] for r in runners}
    for round_index in range(repeats):
        shift = round_index % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            gc.collect()
            gc.disable()
            try:
                cpu_start = time.process_time()
                wall[runner.key].append(runner.run(updates_of(runner)))
                cpu[runner.key].append(time.process_time() - cpu_start)
            finally:
                gc.enable()
    return wall, cpu


def paired_ratios(times: list, baseline_times: list) -> list:
    if len(times) != len(baseline_times):
        raise ValueError("paired ratios need one baseline time per round.")
    return [t / b for t, b in zip(times, baseline_times)]


# --- all-reduces -------------------------------------------------------------------


def placement_record(runner) -> dict:
    """Graph placement of each traced function: {function: {every_call, conditional}}."""
    return {name: {"every_call": p.every_call, "conditional": p.conditional}
            for name, p in runner.placement().items()}


def derived_all_reduces(placement: dict, before: dict, after: dict) -> int:
    """Sum over functions of every_call x calls + conditional x branch runs (deltas)."""
    total = 0
    for name, counts in placement.items():
        calls = after[name][0] - before[name][0]
        branch_runs = after[name][1] - before[name][1]
        total += counts["every_call"] * calls + counts["conditional"] * branch_runs
    return total


def all_reduce_events(xspace_bytes: bytes) -> int:
    """Executed all-reduce kernels in a serialized `XSpace` (host planes only).

    The host tracer names each executed op `<op name>:<op type>`; device planes (GPU
    kernels) are left out so an op is not counted twice.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(xspace_bytes)
    count = 0
    for plane in space.planes:
        if not plane.name.startswith("/host:"):
            continue
        op_types = {mid: md.name.rpartition(":")[2] for mid, md in plane.event_metadata.items()}
        for line in plane.lines:
            count += sum(op_types.get(ev.metadata_id) in ALL_REDUCE_OP_TYPES
                         for ev in line.events)
    return count


def profiled_kernels(fn) -> int:
    """Executed all-reduce kernels (all replicas) in a profiler trace of `fn()`.

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
        kernels = 0
        for path in files:
            with open(path, "rb") as f:
                kernels += all_reduce_events(f.read())
    return kernels


def all_reduce_record(runner, updates: int = 1, with_graph: bool = True,
                      attempts: int = 3) -> dict:
    """Graph, derived and profiler-measured all-reduces per accumulated update.

    The host tracer occasionally drops an event (seen here on CPU, rarely): a kernel count that is not a multiple of the replica count is an
    incomplete trace, so the update is run and traced again, up to `attempts` times; the
    record says how many traces it took. Raises ValueError if every trace was incomplete.
    """
    record = {}
    placement = placement_record(runner) if with_graph else None
    before = runner.executions()
    traces = []
    for _ in range(attempts):
        traces.append(profiled_kernels(lambda: runner.run(updates)))
        if traces[-1] % runner.replicas == 0:
            break
    else:
        raise ValueError(f"all-reduce kernel counts {traces} are not multiples of "
                         f"{runner.replicas} replicas: incomplete profiler traces.")
    after = runner.executions()
    record["measured_per_update"] = traces[-1] / runner.replicas / updates
    record["profiler_traces"] = len(traces)
    if placement is not None:
        record["graph"] = placement
        ran = updates * len(traces)
        record["calls_per_update"] = {
            name: {"calls": (after[name][0] - before[name][0]) / ran,
                   "branch_runs": (after[name][1] - before[name][1]) / ran}
            for name in placement}
        record["derived_per_update"] = derived_all_reduces(placement, before, after) / ran
    return record


# --- memory --------------------------------------------------------------------------


def allocator_record(runner, physical_gpus: int) -> dict:
    """Allocator bytes of one accumulated update (`runner.run(1)`), and the approach's
    persistent buffers per replica."""
    device = allocator_device(physical_gpus)
    step = measure_step_memory(lambda: runner.run(1), device)
    return {"device": step.device, "current_before": step.current_before, "peak": step.peak,
            "step_bytes": step.step_bytes,
            "state_bytes_per_replica": runner.state_bytes_per_replica()}
