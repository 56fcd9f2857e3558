"""distgrad: how gradients move through tf.distribute, with tested reference code."""

from distgrad.accumulator import GradientAccumulator, plan_micro_batches, train_accumulated
from distgrad.callpath import record_sync_path, summarize_path
from distgrad.collectives import CollectiveCount, count_collectives
from distgrad.devices import environment_report, make_strategy
from distgrad.equivalence import (
    big_batch_reference,
    check_close,
    check_not_close,
    regression_data,
    tiny_model,
    weight_diff,
    weights_of,
)
from distgrad.legacy import run_legacy
from distgrad.optimizer import AccumulatingOptimizer
from distgrad.sync import clip_by_global_norm_across_replicas, make_replica_step, run_steps
from distgrad.train_step import (
    MicroBatching,
    MicroBatchingModel,
    check_micro_batches,
    with_micro_batches,
)

__version__ = "0.1.0"

__all__ = [
    "GradientAccumulator",
    "plan_micro_batches",
    "train_accumulated",
    "AccumulatingOptimizer",
    "MicroBatching",
    "MicroBatchingModel",
    "check_micro_batches",
    "run_legacy",
    "with_micro_batches",
    "CollectiveCount",
    "big_batch_reference",
    "check_close",
    "check_not_close",
    "clip_by_global_norm_across_replicas",
    "count_collectives",
    "environment_report",
    "make_replica_step",
    "make_strategy",
    "record_sync_path",
    "regression_data",
    "run_steps",
    "summarize_path",
    "tiny_model",
    "weight_diff",
    "weights_of",
]
