"""Claims of docs/call-path.md that no lesson asserts, checked on the installed TF/Keras.

The page says one Keras 3 optimizer step under MirroredStrategy (CPU, no XLA) makes three
`merge_call`s per replica — the all-reduce's `batch_all_reduce`, the update
`_distributed_tf_update_step`, and the ON_WRITE `iterations.assign_add(1)` — and that the
all-reduce itself (`batch_reduce_to`) runs once, in cross-replica context.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from site_helpers import ROOT

PROBE = textwrap.dedent(
    """
    import collections, json, traceback
    import distgrad
    strategy = distgrad.make_strategy(2)
    import keras, tensorflow as tf
    from tensorflow.python.distribute import distribute_lib
    from distgrad.lab.data import regression_data
    from distgrad.lab.recipes import make_replica_step

    x, y = regression_data(16)
    with strategy.scope():
        model, optimizer = distgrad.tiny_model(), keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    step = make_replica_step(16)
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16))))

    merge_fns, reduce_contexts = [], []
    merge_call = distribute_lib.ReplicaContext.merge_call
    batch_reduce_to = distribute_lib.StrategyExtendedV2.batch_reduce_to

    def spy_merge_call(self, merge_fn, args=(), kwargs=None):
        merge_fns.append(getattr(merge_fn, "__qualname__", repr(merge_fn)))
        return merge_call(self, merge_fn, args, kwargs)

    def spy_batch_reduce_to(self, *args, **kwargs):
        reduce_contexts.append(tf.distribute.in_cross_replica_context())
        return batch_reduce_to(self, *args, **kwargs)

    distribute_lib.ReplicaContext.merge_call = spy_merge_call
    distribute_lib.StrategyExtendedV2.batch_reduce_to = spy_batch_reduce_to

    @tf.function
    def distributed_step(batch):
        return strategy.run(step, args=(model, optimizer, *batch))

    distributed_step.get_concrete_function(batch)
    print(json.dumps({"merge_fns": collections.Counter(merge_fns),
                      "reduce_contexts": reduce_contexts}))
    """
)


def test_one_sgd_step_makes_three_merge_calls_per_replica_and_one_cross_replica_reduce():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["merge_fns"] == {
        "ReplicaContextBase.all_reduce.<locals>.batch_all_reduce": 2,
        "TFOptimizer._distributed_tf_update_step": 2,
        "_on_write_update_replica.<locals>.merge_fn": 2,
    }
    assert seen["reduce_contexts"] == [True]
