"""distgrad_course: the instruments of the distgrad course, apart from the library.

`distgrad` ships the reference classes only. What the lessons, the tests and the
benchmarks use to show and check them lives here:

* `make_strategy`, `environment_report` (`devices.py`): the devices a lesson runs on (GPUs,
  or logical CPUs on a laptop), created before any other TensorFlow work;
* `distgrad_course.lab`: tiny models and data, comparisons, recipes, graph inspection, the
  call spy, the child-process runner and its fork server, worker clusters, the backup and
  resume experiments;
* `distgrad_course.pitfalls`: deterministic reproductions of the mistakes the lessons are
  about;
* `version_matrix.py`: the driver of `make matrix` (standard library only), with
  `matrix_results.py` (a run's results) and `matrix_tables.py` (the tables).

It imports the library; the library never imports it.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"
_EXPORTS = {"make_strategy": "distgrad_course.devices",
            "environment_report": "distgrad_course.devices"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distgrad_course' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
