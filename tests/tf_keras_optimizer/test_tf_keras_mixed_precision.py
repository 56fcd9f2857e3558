"""The third question's stack with distgrad.tf_keras: tf-keras, `mixed_float16`, `model.fit`,
the question's `train_step` and `LossScaleOptimizer(AccumulatingOptimizer(inner, k))`.

One tf-keras child (`tests/tf_keras_children.py:mixed_precision`) runs every scenario.
"""

import os

import numpy as np
import pytest

from distgrad_course.lab.compare import check_close
from distgrad_course.lab.mixed import check_float16_close, overflow_data
from distgrad_course.lab.tf_keras_runner import run_tf_keras

TESTS_ON_PATH = {"PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}  # tests/
REPLICAS, MICRO_BATCH, K, MICRO_BATCHES, OVERFLOW = 2, 8, 2, 7, 3
SCALE = 2.0**10  # below the default 2**15, so that the only overflow is the injected one
BIG_BATCH_PER_REPLICA = K * MICRO_BATCH // REPLICAS  # examples summed in float16


@pytest.fixture(scope="module")
def mixed():
    x, y = overflow_data(MICRO_BATCHES - 1, MICRO_BATCH, None, REPLICAS)
    x7, y7 = overflow_data(MICRO_BATCHES, MICRO_BATCH, OVERFLOW, REPLICAS,
                           overflow_replicas=(1,))
    keep = np.r_[0:(OVERFLOW - 1) * MICRO_BATCH, OVERFLOW * MICRO_BATCH:len(x7)]
    return run_tf_keras("tf_keras_children:mixed_precision", REPLICAS, env=TESTS_ON_PATH,
                      x=x.tolist(), y=y.tolist(), overflowing=[x7.tolist(), y7.tolist()],
                      without=[x7[keep].tolist(), y7[keep].tolist()], micro_batch=MICRO_BATCH,
                      accumulation_steps=K, initial_scale=SCALE, stop_after=OVERFLOW + 1)


def test_compile_under_mixed_float16_puts_the_loss_scale_optimizer_outside(mixed):
    assert mixed["compiled"] == ["LossScaleOptimizerV3", "AccumulatingOptimizer", True]


@pytest.mark.parametrize("name", ["momentum", "adam", "legacy momentum",
                                  "adam, stock train_step"])
def test_question_train_step_accumulated_equals_big_batch_under_mixed_float16(mixed, name):
    run = mixed[name]
    check_float16_close(run["accumulated"], run["big_batch"], mixed["initial"],
                        BIG_BATCH_PER_REPLICA, what=name)
    rows = run["rows"]
    assert {r["loss_scale"] for r in rows} == {SCALE}  # no overflow in the clean data
    assert [r["updates"] for r in rows] == [(t + 1) // K for t in range(MICRO_BATCHES - 1)]
    assert [r["iterations"] for r in rows] == [r["updates"] for r in rows]


def test_an_overflow_on_one_replica_skips_that_micro_batch_everywhere_and_halves_once(mixed):
    rows = mixed["overflow"]["rows"]
    assert [r["loss_scale"] for r in rows] == [SCALE] * (OVERFLOW - 1) + [SCALE / 2] * (
        MICRO_BATCHES - OVERFLOW + 1)
    assert [r["total_micro_steps"] for r in rows] == [1, 2, 2, 3, 4, 5, 6]  # 3 not accumulated
    assert [r["updates"] for r in rows] == [0, 1, 1, 1, 2, 2, 3]  # Adam / momentum steps
    assert [r["iterations"] for r in rows] == [0, 1, 2, 2, 3, 3, 4]  # + the skipped step
    assert {r["skipped_updates"] for r in rows} == {0} and all(r["weights_finite"] for r in rows)
    # the same as three big-batch steps on the data without the overflowing micro-batch
    check_float16_close(mixed["overflow"]["accumulated"], mixed["overflow"]["big_batch_without"],
                        mixed["initial"], BIG_BATCH_PER_REPLICA)


def test_a_checkpoint_mid_cycle_restores_the_loss_scale_and_the_cycle(mixed):
    record = mixed["checkpoint"]
    assert record["restored"] == {"loss_scale": SCALE / 2, "micro_steps": 1, "updates": 1}
    check_close(record["final"], mixed["overflow"]["accumulated"])


def test_under_the_loss_scale_a_one_element_flag_is_all_reduced_every_micro_batch(mixed):
    traces = mixed["all_reduces"]
    assert traces and all(calls == [{"values": 1, "in_cond": False},  # all replicas finite?
                                    {"values": 4, "in_cond": True}]  # the cycle's gradients
                          for calls in traces)
