"""`distgrad.sparse`, the `tf.IndexedSlices` helpers: `deduplicate` sums repeated rows into
one, keeping the dense value, and passes a dense tensor through; `has_duplicate_indices`
sees repeated rows; `dense_bytes` and `sparse_bytes` give the sizes of both forms.
"""

import numpy as np
import tensorflow as tf

from distgrad.sparse import deduplicate, dense_bytes, has_duplicate_indices, sparse_bytes


def test_deduplicate_sums_repeated_rows_and_keeps_the_dense_value():
    slices = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]), tf.constant([3, 1, 3]),
                              tf.constant([5, 1]))
    assert has_duplicate_indices(slices)
    unique = deduplicate(slices)
    assert not has_duplicate_indices(unique)
    np.testing.assert_array_equal(tf.convert_to_tensor(unique), tf.convert_to_tensor(slices))
    assert sorted(unique.indices.numpy().tolist()) == [1, 3]
    dense = tf.ones([2, 2])
    assert deduplicate(dense) is dense
    assert dense_bytes(slices) == 5 * 4 and sparse_bytes(slices) == 3 * 4 + 3 * 4
