"""How long freeing a `tf.data` iterator takes, against the iterator's age.

    .venv/bin/python -m benchmarks.iterator_free            # ages 0.2, 2, 8 s; 8 rounds each
    .venv/bin/python -m benchmarks.iterator_free --quick    # smoke size

An iterator whose options have autotuning on (the default) owns a model thread
(`RootDataset::Iterator`, `Model::OptimizeLoop`) that sleeps between optimizations for a
period that doubles from 10 ms up to 60 s, so roughly the iterator's age. Freeing the
iterator cancels that thread and joins it, with the GIL held (the free runs in
`EagerTensor_dealloc`). Sometimes the thread misses the cancellation and sleeps out its
period first: the free then blocks every Python thread for seconds. This measures it, with
TensorFlow only: per round, a fresh iterator over `range().map(AUTOTUNE).prefetch(AUTOTUNE)`
reads one element, sleeps `age` seconds, and `del` is timed; the same with
`options.autotune.enabled = False`. Prints one JSON object: every round's seconds, and per
age the median, the maximum and how many rounds took over 0.1 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def free_seconds(age: float, autotune: bool) -> float:
    import tensorflow as tf

    data = tf.data.Dataset.range(1 << 40).map(lambda i: i + 1,
                                               num_parallel_calls=tf.data.AUTOTUNE)
    data = data.prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.autotune.enabled = autotune
    iterator = iter(data.with_options(options))
    next(iterator)
    time.sleep(age)
    start = time.perf_counter()
    del iterator
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    ages, rounds = ((0.2, 1.0), 2) if args.quick else ((0.2, 2.0, 8.0), 8)
    import tensorflow as tf

    result = {"tensorflow": tf.__version__, "rounds": rounds, "ages_s": list(ages)}
    for autotune in (True, False):
        for age in ages:
            seconds = [round(free_seconds(age, autotune), 4) for _ in range(rounds)]
            result[f"autotune={'on' if autotune else 'off'} age={age}s"] = {
                "free_s": seconds, "median_s": statistics.median(seconds),
                "max_s": max(seconds), "over_0.1s": sum(s > 0.1 for s in seconds)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
