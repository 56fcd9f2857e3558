"""Sparse (`tf.IndexedSlices`) gradients: duplicates, and what optimizers make of them.

An `Embedding` lookup's gradient is a `tf.IndexedSlices` with one row per *lookup*, so a
token that appears twice in the batch appears twice in `indices`. Linear updates (SGD,
plain momentum) don't care: `scatter_add` sums the duplicates. Keras 3's Adam does: in
`Adam.update_step`, `ops.square(gradient)` squares each *row* of the IndexedSlices
(`keras/src/backend/tensorflow/sparse.py`, `elementwise_unary`) before the duplicates
are summed, so the second moment gets a^2 + b^2 instead of (a + b)^2. Likewise
`global_clipnorm` computes the norm over the duplicated rows. Untouched rows are *not*
the difference: `ops.subtract(gradient, m)` densifies, so every row's moments decay.

`deduplicate` sums duplicate rows (what TF1 optimizers did with
`_deduplicate_indexed_slices`); afterwards the sparse update equals the dense one.
"""

from __future__ import annotations

import tensorflow as tf


def deduplicate(gradient):
    """Sum the rows of a `tf.IndexedSlices` that share an index; other values pass through.

    The result has unique (sorted-by-first-appearance) indices and the same dense value.
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    unique_indices, positions = tf.unique(gradient.indices)
    summed = tf.math.unsorted_segment_sum(
        gradient.values, positions, tf.shape(unique_indices)[0]
    )
    return tf.IndexedSlices(summed, unique_indices, gradient.dense_shape)


def has_duplicate_indices(gradient) -> bool:
    """True for an IndexedSlices whose `indices` repeat (eager tensors only)."""
    if not isinstance(gradient, tf.IndexedSlices):
        return False
    return int(tf.size(tf.unique(gradient.indices)[0])) < int(tf.size(gradient.indices))


def dense_bytes(gradient) -> int:
    """Bytes a dense buffer for this gradient takes (what a dense accumulator allocates)."""
    shape = gradient.dense_shape if isinstance(gradient, tf.IndexedSlices) else tf.shape(gradient)
    return int(tf.reduce_prod(shape)) * gradient.dtype.size


def sparse_bytes(gradient) -> int:
    """Bytes of an IndexedSlices' values and indices (what a sparse buffer holds)."""
    if not isinstance(gradient, tf.IndexedSlices):
        return dense_bytes(gradient)
    return (int(tf.size(gradient.values)) * gradient.values.dtype.size
            + int(tf.size(gradient.indices)) * gradient.indices.dtype.size)
