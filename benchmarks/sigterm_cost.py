"""What `BackupAndRestore`'s `SIGTERM` handling costs per batch on 2 workers.

    .venv/bin/python -m benchmarks.sigterm_cost            # 2 workers, 4 rounds of 60 batches
    .venv/bin/python -m benchmarks.sigterm_cost --quick    # smoke size

A local `MultiWorkerMirroredStrategy` cluster of 2 worker processes (`distgrad_course.lab`'s, on
the CPU) trains lesson 08's model (`AccumulatingOptimizer(Adam, 3)`) with
`BackupAndRestore(save_freq="epoch")`, one epoch per `fit`, in paired rounds: with
`handle_sigterm=False` and `True`, the order alternating. Per `fit`: the median time
between batch ends, and the `fit`'s wall time (the handler's one-off costs: its watcher
thread, the coordination-service key that stops it). Apart: `SigtermWatch.due`, the only
work the handler adds to a batch, timed alone. Prints one JSON object (the chief's).

The sizes are small because a worker's OS threads grow with the batches it trains, with
or without the handler (measured on TF 2.21, CPU: about 2,700 more per `fit` of 200
batches, in /proc/<pid>/task): 14 fits of 200 batches aborted a worker ("Resource
temporarily unavailable").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time


def worker(task_index: int, num_workers: int, batches: int, rounds: int) -> dict:
    """On every worker: the paired rounds; the chief's numbers are returned."""
    import keras

    from distgrad.backup_and_restore import BackupAndRestore, SigtermWatch, cluster_of
    from distgrad_course.lab import backup
    from distgrad_course.lab.local_cluster import make_worker_strategy

    strategy = make_worker_strategy(60.0)
    model = backup.build(strategy, "accumulating", multi_worker=True)
    data = backup.dataset(batches)

    class BatchEnds(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    timer, root = BatchEnds(), tempfile.mkdtemp(prefix="sigterm-cost-")
    runs = {False: {"batch_ms": [], "fit_s": []}, True: {"batch_ms": [], "fit_s": []}}
    for index in range(rounds + 1):  # round 0 warms up (traces the step), not counted
        for handle in ((False, True) if index % 2 else (True, False)):
            callback = BackupAndRestore(os.path.join(root, f"{index}-{handle}"),
                                        handle_sigterm=handle)
            start = time.perf_counter()
            model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[callback, timer])
            if index:
                runs[handle]["fit_s"].append(time.perf_counter() - start)
                steps = [b - a for a, b in zip(timer.times[10:], timer.times[11:])]
                runs[handle]["batch_ms"].append(1e3 * statistics.median(steps))
    watch = SigtermWatch(cluster_of(strategy))
    calls = 100_000
    start = time.perf_counter()
    for trained in range(1, calls + 1):
        watch.due(trained)
    due_ns = 1e9 * (time.perf_counter() - start) / calls
    watch.close()
    summary = {handle: {"batch_ms_median": statistics.median(r["batch_ms"]),
                        "batch_ms_rounds": [round(x, 4) for x in r["batch_ms"]],
                        "fit_s_median": statistics.median(r["fit_s"])}
               for handle, r in runs.items()}
    return {"workers": num_workers, "batches_per_fit": batches, "rounds": rounds,
            "handle_sigterm_false": summary[False], "handle_sigterm_true": summary[True],
            "extra_ms_per_batch": (summary[True]["batch_ms_median"]
                                   - summary[False]["batch_ms_median"]),
            "extra_s_per_fit": summary[True]["fit_s_median"] - summary[False]["fit_s_median"],
            "due_ns_per_call": due_ns, "python_threads_at_end": threading.active_count()}


def main(argv=None) -> dict:
    from distgrad_course.lab.local_cluster import run_workers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 40 batches")
    args = parser.parse_args(argv)
    batches, rounds = (40, 2) if args.quick else (60, 4)
    results = run_workers("benchmarks.sigterm_cost:worker", num_workers=2, timeout=600,
                          batches=batches, rounds=rounds)
    summary = results[0].check().value
    results[1].check()
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
