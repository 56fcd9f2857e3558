"""What a mid-epoch resume costs before its first trained batch, at batch 1,000: with the
data iterator's saved state restored (one device, no strategy) and with the batches the
backup holds read and dropped (under `MirroredStrategy`, whose iterator TensorFlow 2.21
cannot save).

    .venv/bin/python -m benchmarks.resume_cost            # backup at batch 1,000, 5 rounds
    .venv/bin/python -m benchmarks.resume_cost --quick    # smoke size

One process, lesson 08's model (`AccumulatingOptimizer(Adam, 3)`) as a
`ResumableFitModel`, over a `tf.data` pipeline of global batches of 8 whose map costs
`map_work` chained `tf.sin` ops per example (0: a plain slice); once with no strategy
("restored") and once under `MirroredStrategy` on 1 CPU ("read and dropped"). For each:
one `fit` is stopped after batch `at` with a backup there; then, per round, a fresh
model's `fit` resumes from a copy of that backup, and a fresh model's `fit` starts with no
backup. Each is timed from `fit`'s call to the end of its first trained batch; the
difference of the medians is the resume's cost. `read_ms_per_batch`: the pipeline alone,
read in a loop; `skip_s`: `Dataset.skip(at)` then one element (the map still runs on the
skipped elements: skipping cannot avoid the reads). Prints one JSON object, every round.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time


def pipeline(batches: int, map_work: int):
    import tensorflow as tf

    from distgrad_course.lab import backup

    x, y = backup.examples(batches)

    def work(features, target):
        value = features
        for _ in range(map_work):
            value = tf.sin(value)
        return features + 0.0 * value, target  # the same examples, after the work

    data = tf.data.Dataset.from_tensor_slices((x, y))
    if map_work:
        data = data.map(work)
    return data.batch(backup.GLOBAL_BATCH, drop_remainder=True)


def timed_fit(strategy, backup_dir: str, data, stop_after: int) -> float:
    """Seconds from `fit`'s call to the end of its first trained batch (the optimizer's
    micro-batch count goes up), then `fit` stops."""
    import keras

    from distgrad.backup_and_restore import BackupAndRestore
    from distgrad_course.lab import backup

    model = backup.build(strategy, "accumulating")
    counter = model.optimizer.total_micro_steps
    ends = []

    class FirstTrained(keras.callbacks.Callback):  # after BackupAndRestore: restored count
        def on_train_begin(self, logs=None):
            self.before = int(counter.numpy())

        def on_train_batch_end(self, batch, logs=None):
            if int(counter.numpy()) > self.before:
                ends.append(time.perf_counter())
                self.model.stop_training = True

    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[
        BackupAndRestore(backup_dir, save_freq=stop_after, delete_checkpoint=False),
        FirstTrained()])
    return ends[0] - start


def measure(strategy, at: int, rounds: int, map_work: int, position: str) -> dict:
    import tensorflow as tf

    from distgrad_course.lab import backup

    data = pipeline(2 * at, map_work)
    source = tempfile.mkdtemp(prefix="resume-cost-")
    try:
        backup.one_fit(strategy, source, save_freq=at, data=data, stop=backup.Interrupt(at))
    except backup.Preempted:
        pass
    resumed, fresh = [], []
    for _ in range(rounds + 1):  # round 0 warms up
        copy = tempfile.mkdtemp(prefix="resume-cost-")
        shutil.rmtree(copy)
        shutil.copytree(source, copy)
        resumed.append(timed_fit(strategy, copy, data, 10 * at))
        fresh.append(timed_fit(strategy, tempfile.mkdtemp(prefix="resume-cost-"), data, 10 * at))
    start = time.perf_counter()
    for _ in data.take(at):
        pass
    read = time.perf_counter() - start
    start = time.perf_counter()
    next(iter(data.skip(at)))
    skip = time.perf_counter() - start
    tf.keras.backend.clear_session()
    resumed, fresh = resumed[1:], fresh[1:]
    return {"position": position, "map_work": map_work, "backup_at_batch": at,
            "resume_s_median": statistics.median(resumed),
            "fresh_s_median": statistics.median(fresh),
            "resume_cost_s": statistics.median(resumed) - statistics.median(fresh),
            "resume_s_rounds": [round(v, 3) for v in resumed],
            "fresh_s_rounds": [round(v, 3) for v in fresh],
            "read_ms_per_batch": 1e3 * read / at, "skip_s": skip}


def main(argv=None) -> dict:
    from distgrad_course.devices import make_strategy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="backup at batch 50, 2 rounds")
    args = parser.parse_args(argv)
    at, rounds = (50, 2) if args.quick else (1000, 5)
    import tensorflow as tf

    runs = {"restored": tf.distribute.get_strategy(), "read and dropped": make_strategy(1)}
    summary = {"rounds": rounds, "runs": [measure(strategy, at, rounds, work, position)
                                          for position, strategy in runs.items()
                                          for work in (0, 200)]}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
