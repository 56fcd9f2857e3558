"""Claims of docs/call-path.md that no lesson asserts, checked on the installed TF/Keras.

The page says one Keras 3 optimizer step under MirroredStrategy (CPU, no XLA) makes three
`merge_call`s per replica — the all-reduce's `batch_all_reduce`, the update
`_distributed_tf_update_step`, and the ON_WRITE `iterations.assign_add(1)` — and that the
all-reduce itself (`batch_reduce_to`) runs once, in cross-replica context.
"""

from __future__ import annotations

import os

from site_helpers import ROOT

from distgrad_course.lab.child import run_child


def test_one_sgd_step_makes_three_merge_calls_per_replica_and_one_cross_replica_reduce():
    path = os.pathsep.join([str(ROOT / "tests_site"), str(ROOT / "src")])
    seen = run_child("call_path_probe:merge_calls_of_one_sgd_step", timeout=300,
                     env={"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": path}).value
    assert seen["merge_fns"] == {
        "ReplicaContextBase.all_reduce.<locals>.batch_all_reduce": 2,
        "TFOptimizer._distributed_tf_update_step": 2,
        "_on_write_update_replica.<locals>.merge_fn": 2,
    }
    assert seen["reduce_contexts"] == [True]
