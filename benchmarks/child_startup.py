"""What one `distgrad_course.lab.child` child costs: forked from the fork server or a
fresh interpreter.

    .venv/bin/python -m benchmarks.child_startup                # 8 interleaved pairs
    .venv/bin/python -m benchmarks.child_startup --pairs 3 --json out.json

Run it from the repository root: the children import their targets from this module
(`benchmarks.child_startup:...`), which they find because a child's `sys.path[0]` is its
working directory, as for `python -m` (forked and fresh children alike).

Two targets: `import_keras` (imports TensorFlow and Keras, returns: what a child costs
before it does anything) and `tiny_fit` (a `MirroredStrategy` over 2 logical CPUs and one
small `fit` with `AccumulatingOptimizer`: a typical real child). For each pair and target
it runs one forked child (`DISTGRAD_FORK_SERVER=1`) and one fresh interpreter
(`DISTGRAD_FORK_SERVER=0`, read per `Child`), in alternating order. Before the pairs,
one forked `import_keras` child starts the server: its wall time (which includes the
server's start) and the server's own CPU time are reported apart.

Per child it reports wall seconds (`ChildResult.seconds`), the CPU seconds the child
process itself used up to its return (`RUSAGE_SELF` inside it; a fork starts at zero),
and this process' `RUSAGE_CHILDREN` delta. The latter counts a fresh interpreter but not
a forked child: that one is the grandchild of the server, whose monitors are reaped by the
kernel, so its CPU never reaches us. Load averages are printed before and after: the
numbers mean little on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from distgrad_course.lab import fork_server
from distgrad_course.lab.child import run_child

TARGETS = ("benchmarks.child_startup:import_keras", "benchmarks.child_startup:tiny_fit")
MODES = {"forked": "1", "fresh": "0"}


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def import_keras() -> dict:
    """In the child: import TensorFlow and Keras (already imported in a forked child)."""
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    return {"cpu_s": _own_cpu()}


def tiny_fit(replicas: int = 2) -> dict:
    """In the child: a MirroredStrategy over `replicas` logical CPUs, one small fit."""
    from distgrad_course.devices import make_strategy

    strategy = make_strategy(replicas)
    import keras
    import numpy as np

    from distgrad.optimizer import AccumulatingOptimizer

    x = np.linspace(-1, 1, 64 * 4, dtype=np.float32).reshape(64, 4)
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(AccumulatingOptimizer(keras.optimizers.SGD(0.05), accumulation_steps=2),
                      loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return {"cpu_s": _own_cpu(), "replicas": strategy.num_replicas_in_sync}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process_cpu(pid: int) -> float | None:
    """CPU seconds of the live process `pid` so far (utime + stime, /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(target: str, mode: str) -> dict:
    """Run `target` in one child of `mode`; its wall, in-child and RUSAGE_CHILDREN CPU."""
    os.environ[fork_server.ENV] = MODES[mode]
    before = _children_cpu()
    start = time.monotonic()
    result = run_child(target)
    wall_outside = time.monotonic() - start
    return {"target": target.partition(":")[2], "mode": mode, "wall_s": result.seconds,
            "wall_outside_s": wall_outside, "child_cpu_s": result.value["cpu_s"],
            "rusage_children_cpu_s": _children_cpu() - before}


def _summary(rows: list[dict], key: str) -> str:
    values = [row[key] for row in rows]
    return (f"median {statistics.median(values):6.2f}  min {min(values):6.2f}  "
            f"max {max(values):6.2f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--json", help="also write every row to this file")
    args = parser.parse_args(argv)
    if not fork_server.enabled():
        sys.exit("the fork server is off here (not Linux, or DISTGRAD_FORK_SERVER=0)")
    load_before = os.getloadavg()
    print(f"cpus {os.cpu_count()}, load before {load_before}", flush=True)

    # The first forked child starts the server: reported apart, not in the medians.
    os.environ[fork_server.ENV] = "1"
    first = run_child(TARGETS[0])
    server_pid = next(iter(fork_server._servers.values())).process.pid
    server_cpu_after_start = _process_cpu(server_pid)
    print(f"first forked child (starts the server): {first.seconds:.2f} s wall; the server "
          f"used {server_cpu_after_start:.2f} s CPU so far", flush=True)

    rows = []
    for pair in range(args.pairs):
        for target in TARGETS:
            order = ("forked", "fresh") if pair % 2 == 0 else ("fresh", "forked")
            for mode in order:
                row = one(target, mode)
                row.update(pair=pair, load1=os.getloadavg()[0])
                rows.append(row)
                print(f"pair {pair} {row['target']:12s} {mode:6s} wall {row['wall_s']:6.2f} s "
                      f"child CPU {row['child_cpu_s']:6.2f} s rusage-children CPU "
                      f"{row['rusage_children_cpu_s']:6.2f} s (load1 {row['load1']:.2f})",
                      flush=True)
    server_cpu_end = _process_cpu(server_pid)
    load_after = os.getloadavg()

    print(f"\n{args.pairs} interleaved pairs; load before {load_before}, after {load_after}")
    print(f"server start: first forked child {first.seconds:.2f} s wall, server CPU "
          f"{server_cpu_after_start:.2f} s at start, {server_cpu_end:.2f} s at the end")
    for target in TARGETS:
        name = target.partition(":")[2]
        for mode in MODES:
            chosen = [row for row in rows if row["target"] == name and row["mode"] == mode]
            print(f"{name:12s} {mode:6s} wall s: {_summary(chosen, 'wall_s')} | child CPU s: "
                  f"{_summary(chosen, 'child_cpu_s')} | rusage-children CPU s: "
                  f"{_summary(chosen, 'rusage_children_cpu_s')}")
    report = {"cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after,
              "first_forked_wall_s": first.seconds,
              "server_cpu_s": {"after_start": server_cpu_after_start, "end": server_cpu_end},
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
