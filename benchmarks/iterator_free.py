"""How long freeing a `tf.data` iterator takes, against the iterator's age.

    .venv/bin/python -m benchmarks.iterator_free               # 8 rounds: docs/performance/
    .venv/bin/python -m benchmarks.iterator_free --quick       # benchmarks/results/quick/
    .venv/bin/python -m benchmarks.iterator_free --report-only # the table from the JSON

An iterator whose options have autotuning on (the default) owns a model thread
(`RootDataset::Iterator`, `Model::OptimizeLoop`) that sleeps between optimizations for a
period that doubles from 10 ms up to 60 s. Freeing the iterator cancels that thread and
joins it, with the GIL held (the free runs in `EagerTensor_dealloc`). Sometimes the thread
misses the cancellation and sleeps out its period first: the free then blocks every Python
thread. This measures it with TensorFlow only: per round, a fresh iterator over
`range().map(AUTOTUNE).prefetch(AUTOTUNE)` reads one element, is kept `age` seconds, and
its `del` is timed; the same with `options.autotune.enabled = False`. Writes
`iterator_free.json` (every round's seconds) and the table `iterator-free.md` that
docs/performance.md includes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "performance"
QUICK_OUT = OUT.parents[1] / "benchmarks" / "results" / "quick"  # never over the docs' data
SLOW_S = 0.1  # a free is "slow" above this; a plain one takes about a millisecond


def free_seconds(age: float, autotune: bool) -> float:
    import tensorflow as tf

    data = tf.data.Dataset.range(1 << 40).map(lambda i: i + 1,
                                               num_parallel_calls=tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.autotune.enabled = autotune
    iterator = iter(data.prefetch(tf.data.AUTOTUNE).with_options(options))
    next(iterator)
    time.sleep(age)
    start = time.perf_counter()
    del iterator
    return time.perf_counter() - start


def measure(ages, rounds: int) -> dict:
    import tensorflow as tf

    runs = {f"{'on' if autotune else 'off'} {age}": [
        round(free_seconds(age, autotune), 4) for _ in range(rounds)]
        for autotune in (True, False) for age in ages}
    return {"tensorflow": tf.__version__, "rounds": rounds, "ages_s": list(ages),
            "free_s": runs}


def table(results: dict) -> str:
    """One row per age: how many frees took over SLOW_S, how long, with autotuning on and off."""
    def cell(seconds):
        slow = [f"{s:.2f}" for s in sorted(s for s in seconds if s > SLOW_S)]
        fast = max(s for s in seconds if s <= SLOW_S) * 1000
        if not slow:
            return f"0 of {len(seconds)} (all ≤ {fast:.1f} ms)"
        spread = slow[0] if slow[0] == slow[-1] else f"{slow[0]}–{slow[-1]}"
        return f"{len(slow)} of {len(seconds)}: {spread} s (the others ≤ {fast:.1f} ms)"

    rows = [f"| iterator's age | autotuning on: frees over {SLOW_S} s | autotuning off |",
            "|---|---|---|"]
    for age in results["ages_s"]:
        runs = results["free_s"]
        rows.append(f"| {age:g} s | {cell(runs[f'on {age}'])} | {cell(runs[f'off {age}'])} |")
    return "\n".join(rows) + (f"\n\nTensorFlow {results['tensorflow']}, {results['rounds']} "
                              "rounds per cell (`benchmarks/iterator_free.py`).\n")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, ages 0.2 and 1 s")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the table from the JSON in --out; measure nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: docs/performance (quick: benchmarks/results/quick)")
    args = parser.parse_args(argv)
    args.out = args.out or (QUICK_OUT if args.quick else OUT)
    if args.report_only:
        results = json.loads((args.out / "iterator_free.json").read_text())
    else:
        results = measure((0.2, 1.0) if args.quick else (0.2, 2.0, 8.0),
                          2 if args.quick else 8)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "iterator_free.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "iterator-free.md").write_text(table(results), encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
