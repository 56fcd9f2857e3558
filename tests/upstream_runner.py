"""Child-process target of tests/test_upstream_reports.py (run by `distgrad_course.lab.child`,
with tests/ on PYTHONPATH).

A reproduction in docs/upstream/ is a plain script meant to be pasted into an upstream
report, so it runs as `__main__`, the way its reader will run it.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile


def run_script(path: str, names: list[str] | None = None, keras_module: str = "keras") -> dict:
    """Run the script at `path` as `__main__`; never raises.

    Returns `{"values": {name: value}, "error": None | {"type", "message"}}`: the
    script's globals named in `names` that exist when it ends (also when it raised), and
    what it raised, with the module-qualified type name. `keras_module="tf_keras"` makes
    the script's `import keras` load tf-keras (Keras 2) instead of Keras 3.
    """
    if keras_module != "keras":
        sys.modules["keras"] = importlib.import_module(keras_module)
    os.chdir(tempfile.mkdtemp())  # what a script writes (a saved model) stays out of the repo
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    namespace = {"__name__": "__main__", "__file__": path}
    error = None
    try:
        exec(code, namespace)  # running the reproduction is the point
    except Exception as err:  # what the script raised is the result
        error = {"type": f"{type(err).__module__}.{type(err).__qualname__}",
                 "message": str(err)}
    return {"values": {n: namespace[n] for n in names or [] if n in namespace},
            "error": error}


def run_worker_script(task_index: int, num_workers: int, **kwargs) -> dict:
    """`run_script(**kwargs)` in one worker of a local cluster: the target of
    `distgrad_course.lab.local_cluster.run_workers`, which sets this worker's `TF_CONFIG`."""
    return run_script(**kwargs)
