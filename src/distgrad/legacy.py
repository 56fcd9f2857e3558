"""Run a snippet under legacy `tf-keras` (Keras 2) in a fresh Python, get back what it saw.

Many questions this course answers were asked in the Keras 2 era (`tf.keras` before
TensorFlow 2.16). TensorFlow still ships that behaviour as the separate `tf-keras`
package, selected by the environment variable `TF_USE_LEGACY_KERAS=1` — but the
variable is read when TensorFlow is *imported* (`tensorflow/python/util/lazy_loader.py`,
`KerasLazyLoader`), so a process that already imported TensorFlow with Keras 3 cannot
switch. `run_legacy` therefore starts a child Python with the variable set, runs the
snippet there and parses the JSON it reports.

Inside the snippet:

* `tf` is TensorFlow and `tf.keras` is tf-keras (the child checks that `tf.keras.Model`
  comes from the `tf_keras` package and fails loudly otherwise);
* `strategy` is a `tf.distribute.MirroredStrategy` over `replicas` logical CPU devices
  (or GPUs, if the machine has enough), created before any other TensorFlow work;
* `report(**values)` records JSON-serializable values; numpy scalars and arrays are
  converted. Call it as often as you like; later keys overwrite earlier ones.

Batch several observations into one snippet: each child pays TensorFlow's start-up
(several seconds).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

LEGACY_ENV = "TF_USE_LEGACY_KERAS"
RESULT_MARKER = "DISTGRAD_LEGACY_RESULT "
DEFAULT_TIMEOUT_S = 300.0

_PREAMBLE = '''
import json as _json
import os as _os
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
assert _os.environ.get("TF_USE_LEGACY_KERAS") == "1", "TF_USE_LEGACY_KERAS must be set"
import numpy as np
import tensorflow as tf

_replicas = {replicas}
_gpus = tf.config.list_physical_devices("GPU")
if len(_gpus) >= _replicas:
    _devices = [g.name.replace("physical_device:", "") for g in _gpus[:_replicas]]
else:
    _cpu = tf.config.list_physical_devices("CPU")[0]
    if _replicas > 1:
        tf.config.set_logical_device_configuration(
            _cpu, [tf.config.LogicalDeviceConfiguration()] * _replicas)
    _devices = [d.name for d in tf.config.list_logical_devices("CPU")][:_replicas]
strategy = tf.distribute.MirroredStrategy(_devices)

import tf_keras as _tf_keras

if not tf.keras.Model.__module__.startswith("tf_keras"):
    raise RuntimeError(f"tf.keras is {{tf.keras.Model.__module__}}, not tf-keras")

_observed = {{}}


def _plain(value):
    if isinstance(value, dict):
        return {{str(k): _plain(v) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "numpy"):
        value = value.numpy()
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    return value


def report(**values):
    """Record values for the parent (JSON after numpy/tensor conversion)."""
    _observed.update(_plain(values))

'''

_EPILOGUE = '''
print({marker!r} + _json.dumps({{
    "tensorflow": tf.__version__,
    "tf_keras": _tf_keras.__version__,
    "replicas": strategy.num_replicas_in_sync,
    "observed": _observed,
}}), flush=True)
'''


class LegacyRunError(RuntimeError):
    """The legacy child failed, timed out, or reported nothing; the message has its stderr tail."""


@dataclasses.dataclass(frozen=True)
class LegacyResult:
    """What a tf-keras child reported, and the versions it ran on.

    `observed` holds the values the snippet passed to `report(...)`; non-finite floats
    come back as the strings "nan", "inf", "-inf" (JSON has no NaN).
    """

    tensorflow: str
    tf_keras: str
    replicas: int
    observed: dict
    seconds: float

    def __getitem__(self, key):
        return self.observed[key]


def legacy_keras_available() -> bool:
    """True if the `tf_keras` package is importable in this environment."""
    return importlib.util.find_spec("tf_keras") is not None


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_legacy(snippet: str, replicas: int = 1, timeout: float = DEFAULT_TIMEOUT_S,
               env: dict | None = None) -> LegacyResult:
    """Run `snippet` under tf-keras in a child Python and return what it `report`ed.

    The child gets `TF_USE_LEGACY_KERAS=1` in its environment before TensorFlow is
    imported, `replicas` logical devices and a `MirroredStrategy` named `strategy`
    (see the module docstring for what the snippet can use).

    Raises:
        TypeError: `snippet` is not a string.
        ValueError: `replicas` < 1 or `timeout` <= 0.
        LegacyRunError: tf-keras is not installed (install it: `pip install tf-keras`
            matching your TensorFlow minor version), the child exits non-zero (message
            ends with its stderr tail), runs longer than `timeout` seconds, or exits
            without reporting.
    """
    if not isinstance(snippet, str):
        raise TypeError(f"snippet must be Python source text (str), got {type(snippet).__name__}.")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}.")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if not legacy_keras_available():
        raise LegacyRunError(
            "tf-keras is not installed, so legacy Keras 2 cannot be run: "
            "`pip install tf-keras` (the same minor version as tensorflow).")
    code = (_PREAMBLE.format(replicas=replicas) + "\n" + textwrap.dedent(snippet) + "\n"
            + _EPILOGUE.format(marker=RESULT_MARKER))
    child_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {}), LEGACY_ENV: "1"}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=child_env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
        raise LegacyRunError(
            f"the tf-keras child ran longer than {timeout:g} s and was stopped; make the "
            f"snippet smaller or pass a larger timeout. stderr tail:\n{_tail(stderr)}"
        ) from None
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise LegacyRunError(
            f"the tf-keras child exited with status {done.returncode}. stderr tail:\n"
            f"{_tail(done.stderr)}")
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        raise LegacyRunError(
            "the tf-keras child exited without reporting (did the snippet call sys.exit or "
            f"os._exit?). stdout tail:\n{_tail(done.stdout)}\nstderr tail:\n{_tail(done.stderr)}")
    payload = json.loads(lines[-1][len(RESULT_MARKER):])
    return LegacyResult(payload["tensorflow"], payload["tf_keras"], payload["replicas"],
                        payload["observed"], seconds)
