"""Resume training mid-accumulation in a *fresh process*, with `AccumulatingOptimizer`.

Process 1 trains `AccumulatingOptimizer(Adam, steps)` with `model.fit` for part of the
data, stopping inside an accumulation cycle, and saves the model (`model.save`, which
includes the optimizer: inner slots, `micro_steps`, the float32 accumulators). Process
2 — a new Python, a new TensorFlow runtime — loads it under its own strategy and fits
the rest. Its final weights must equal one uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

EXAMPLES = 32
MICRO_BATCH = 4
STEPS = 4
SPLIT = 6 * MICRO_BATCH  # 1 update done, 2 micro-batches of the next cycle accumulated


def _optimizer():
    import keras

    from distgrad.optimizer import AccumulatingOptimizer

    return AccumulatingOptimizer(keras.optimizers.Adam(0.01), accumulation_steps=STEPS)


def uninterrupted_weights(strategy) -> list[np.ndarray]:
    """One `fit` over all the data, in this process: the reference."""
    from distgrad.lab.data import regression_data
    from distgrad.lab.recipes import fit_run

    x, y = regression_data(EXAMPLES)
    return fit_run(strategy, _optimizer, x, y, MICRO_BATCH).final


def _phase(name: str, workdir: str, replicas: int) -> dict:
    import distgrad

    strategy = distgrad.make_strategy(replicas)
    import keras

    from distgrad.lab.compare import weights_of
    from distgrad.lab.data import regression_data
    from distgrad.lab.recipes import fit_run

    x, y = regression_data(EXAMPLES)
    path = os.path.join(workdir, "mid_accumulation.keras")
    if name == "first":
        run = fit_run(strategy, _optimizer, x[:SPLIT], y[:SPLIT], MICRO_BATCH)
        run.model.save(path)
        return {"iterations": run.updates, "micro_steps": run.total_micro_steps}
    with strategy.scope():
        model = keras.models.load_model(path)
    restored = (int(model.optimizer.iterations.numpy()), int(model.optimizer.total_micro_steps.numpy()))
    model.fit(x[SPLIT:], y[SPLIT:], batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    np.savez(os.path.join(workdir, "final.npz"), *weights_of(model))
    return {"restored_iterations": restored[0], "restored_micro_steps": restored[1],
            "iterations": int(model.optimizer.iterations.numpy()),
            "micro_steps": int(model.optimizer.total_micro_steps.numpy())}


def resume_in_fresh_processes(workdir: str, replicas: int = 2, timeout: float = 300) -> dict:
    """Run phase 1 and phase 2 each in a new Python process; return their reports and
    the final weights (`"weights"`). Raises RuntimeError with the child's stderr."""
    reports = {}
    for name in ("first", "rest"):
        done = subprocess.run(
            [sys.executable, "-m", "distgrad.resume", name, workdir, str(replicas)],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        if done.returncode:
            raise RuntimeError(f"phase {name!r} failed:\n{done.stderr[-3000:]}")
        reports[name] = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(os.path.join(workdir, "final.npz")) as final:
        reports["weights"] = [final[f"arr_{i}"] for i in range(len(final.files))]
    return reports


if __name__ == "__main__":
    print(json.dumps(_phase(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
