"""Measurements on runners: paired interleaved timing, all-reduces, op time, memory.

Timing. A shared machine's load changes from second to second, so the runners of one
group are timed *round-robin*: in each round every runner trains one block (the same
number of micro-batches for all), in an order rotated by one each round, and each
approach's time is divided by its path's baseline time *of the same round*. The
median and the spread (min, max, quartiles) of those paired ratios are reported.
Python's garbage collector is paused inside a timed block. The process' CPU time of each
block is recorded too, and compared the same way.

All-reduces, three ways, for one accumulated update (k micro-batches):

* **graph**: `distgrad_course.lab.graph.all_reduce_placement` / `fit_step_placement` on
  each traced function: all-reduces that run on every call, and
  those inside a `tf.cond` branch (run only when it is taken);
* **derived**: graph counts x how often each ran: calls counted by the runner (fit's
  `on_train_batch_end`, loop iterations), cond-branch runs from the wrapped optimizer's
  `iterations` (updates actually made);
* **measured**: executed all-reduce kernels in a TensorFlow profiler trace of the
  update (`benchmarks.trace`), divided by the replica count. A count that is not a
  multiple of the replica count, or below the derived count, is an incomplete trace
  and is retaken (`traced_update`).

The same trace gives the op time of the accumulation's own kernels (`trace.op_time`).
Memory: allocator bytes of one update in this process (`allocator_record`), peak RSS of
three configurations in fresh processes (`fresh_process_memory`).
"""

from __future__ import annotations

import concurrent.futures
import gc
import statistics
import time

from benchmarks import trace
from distgrad_course.lab.args import positive_int
from distgrad_course.lab.memory import (
    allocator_device,
    fresh_process_step_memory,
    measure_step_memory,
)


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
    positive_int("repeats", repeats)
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


def traced_update(runner, updates: int = 1, with_graph: bool = True,
                  attempts: int = 3) -> tuple[dict, dict]:
    """`(all-reduce record, op-time record)` of `updates` updates, from one trace.

    All-reduces per update: graph, derived and profiler-measured (`trace`); op time by
    kernel category (`trace.op_time`) of the same trace. The host tracer occasionally
    drops events (seen here on CPU, rarely) and never adds any: a kernel count that is
    not a multiple of the replica count, none on 2+ replicas, or (`with_graph`) fewer
    than the derived count of the calls traced is an incomplete trace, so the update is
    run and traced again, up to `attempts` times; the record says how many traces it
    took. Raises ValueError if every trace was incomplete.
    """
    record = {}
    placement = placement_record(runner) if with_graph else None
    before = runner.executions()
    traces = []
    for _ in range(attempts):
        start = runner.executions()
        spaces = trace.profile(lambda: runner.run(updates))
        traces.append(sum(trace.all_reduce_events(space) for space in spaces))
        # With 2+ replicas every update all-reduces: a count of 0 is a trace that lost
        # its events (seen on a loaded machine), like a count that is not a multiple of R,
        # or one that lost both replicas' kernels of a call (seen: 1 per update of k=2).
        complete = traces[-1] % runner.replicas == 0 and (runner.replicas == 1 or traces[-1])
        if complete and placement is not None:
            expected = derived_all_reduces(placement, start, runner.executions())
            complete = traces[-1] >= runner.replicas * expected
        if complete:
            break
    else:
        raise ValueError(f"all-reduce kernel counts {traces} on {runner.replicas} replicas: "
                         "incomplete profiler traces.")
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
    return record, trace.op_time(spaces, updates)


# --- memory --------------------------------------------------------------------------


def allocator_record(runner, physical_gpus: int) -> dict:
    """Allocator bytes of one accumulated update (`runner.run(1)`), and the approach's
    persistent buffers per replica."""
    device = allocator_device(physical_gpus)
    step = measure_step_memory(lambda: runner.run(1), device)
    return {"device": step.device, "current_before": step.current_before, "peak": step.peak,
            "step_bytes": step.step_bytes,
            "state_bytes_per_replica": runner.state_bytes_per_replica()}


FRESH_CONFIGS = ("micro_batching", "plain_micro_batch", "plain_big_batch")


def fresh_process_memory(sizes, k: int, replicas: int, physical_gpus: int, log=print,
                         timeout: float = 600) -> list:
    """Peak RSS and allocator bytes of micro-batching vs plain B/k vs plain B, each in a
    fresh process (`distgrad_course.lab.memory.fresh_process_step_memory`)."""
    big = k * sizes.micro_batch
    steps_and_batch = dict(zip(FRESH_CONFIGS, ((k, big), (1, sizes.micro_batch), (1, big))))

    def one(name):
        steps, batch = steps_and_batch[name]
        t0 = time.perf_counter()
        m = fresh_process_step_memory(steps, batch, sizes.features, sizes.hidden,
                                      sizes.layers, replicas, timed_steps=1, timeout=timeout)
        log(f"fresh process {name}: peak RSS {m.rss_peak / 2**20:.0f} MiB "
            f"({time.perf_counter() - t0:.1f} s)")
        return {"config": name, "micro_batches": steps, "batch_size": batch,
                "replicas": replicas, "rss_before": m.rss_before, "rss_peak": m.rss_peak,
                "rss_growth": m.rss_growth, "allocator_device": m.step.device,
                "allocator_step_bytes": m.step.step_bytes}

    # On CPU concurrently: each process' peak RSS and allocator statistic are its own,
    # and no time is reported from these processes. On GPUs one at a time: each process
    # reserves its logical GPUs' memory.
    with concurrent.futures.ThreadPoolExecutor(1 if physical_gpus else len(FRESH_CONFIGS)) as pool:
        return list(pool.map(one, FRESH_CONFIGS))
