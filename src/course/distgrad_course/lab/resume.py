"""Resume training mid-accumulation in a *fresh process*, with `AccumulatingOptimizer`.

Process 1 trains `AccumulatingOptimizer(Adam, ACCUMULATION_STEPS)` with `model.fit` for part of the
data, stopping inside an accumulation cycle, and saves the model (`model.save`, which
includes the optimizer: inner slots, `micro_steps`, the float32 accumulators). Process
2 — a new process, a new TensorFlow runtime — loads it under its own strategy and fits
the rest. Its final weights must equal one uninterrupted run.
"""

from __future__ import annotations

import os

import numpy as np

from distgrad_course.lab.child import run_child

EXAMPLES = 32
MICRO_BATCH = 4
ACCUMULATION_STEPS = 4
SPLIT = 6 * MICRO_BATCH  # 1 update done, 2 micro-batches of the next cycle accumulated


def _optimizer():
    import keras

    from distgrad.optimizer import AccumulatingOptimizer

    return AccumulatingOptimizer(keras.optimizers.Adam(0.01), accumulation_steps=ACCUMULATION_STEPS)


def uninterrupted_weights(strategy) -> list[np.ndarray]:
    """One `fit` over all the data, in this process: the reference."""
    from distgrad_course.lab.data import regression_data
    from distgrad_course.lab.recipes import fit_run

    x, y = regression_data(EXAMPLES)
    return fit_run(strategy, _optimizer, x, y, MICRO_BATCH).final


def phase(name: str, workdir: str, replicas: int) -> dict:
    """In a fresh process: phase "first" (fit to SPLIT, save) or "rest" (load, fit the
    rest, save the final weights to `workdir/final.npz`); returns the counters."""
    from distgrad_course.devices import make_strategy

    strategy = make_strategy(replicas)
    import keras

    from distgrad_course.lab.compare import weights_of
    from distgrad_course.lab.data import regression_data
    from distgrad_course.lab.recipes import fit_run

    x, y = regression_data(EXAMPLES)
    path = os.path.join(workdir, "mid_accumulation.keras")
    if name == "first":
        run = fit_run(strategy, _optimizer, x[:SPLIT], y[:SPLIT], MICRO_BATCH)
        run.model.save(path)
        return {"iterations": run.updates, "micro_steps": run.total_micro_steps}
    # `import distgrad` (the child's first import) registered AccumulatingOptimizer.
    with strategy.scope():
        model = keras.models.load_model(path)
    restored = (int(model.optimizer.iterations.numpy()),
                int(model.optimizer.total_micro_steps.numpy()))
    model.fit(x[SPLIT:], y[SPLIT:], batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    np.savez(os.path.join(workdir, "final.npz"), *weights_of(model))
    return {"restored_iterations": restored[0], "restored_micro_steps": restored[1],
            "iterations": int(model.optimizer.iterations.numpy()),
            "micro_steps": int(model.optimizer.total_micro_steps.numpy())}


def resume_in_fresh_processes(workdir: str, replicas: int = 2, timeout: float = 300) -> dict:
    """Run phase "first" and phase "rest" each in a new process
    (`distgrad_course.lab.child`); return their reports and the final weights (`"weights"`).
    Raises `ChildError` (a RuntimeError) with the child's stderr tail if a phase fails."""
    reports = {}
    for name in ("first", "rest"):
        reports[name] = run_child("distgrad_course.lab.resume:phase",
                                  {"name": name, "workdir": workdir, "replicas": replicas},
                                  timeout=timeout).value
    with np.load(os.path.join(workdir, "final.npz")) as final:
        reports["weights"] = [final[f"arr_{i}"] for i in range(len(final.files))]
    return reports
