"""Pitfall: the same embedding gradient, sparse or dense, gives different Adam updates.

Reproduced on a single Embedding layer and a batch of token ids. With distinct ids the
sparse (`tf.IndexedSlices`) and dense updates are identical; with a repeated id they
differ, and only on the repeated row (Adam) — see `distgrad.sparse` for the mechanism.
Deduplicating the IndexedSlices first makes sparse equal dense.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from distgrad.sparse import deduplicate

GRADIENT_FORMS = ("sparse", "dense", "deduplicated")


def _train_embedding(tokens, form: str, optimizer_factory, steps: int, vocab: int, dim: int):
    embedding = keras.layers.Embedding(
        vocab, dim, embeddings_initializer=keras.initializers.RandomNormal(seed=0))
    embedding.build((None,))
    optimizer = optimizer_factory()
    optimizer.build(embedding.trainable_variables)
    tokens = tf.constant(tokens)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(embedding(tokens) - 1.0))
        (gradient,) = tape.gradient(loss, embedding.trainable_variables)
        if not isinstance(gradient, tf.IndexedSlices):
            raise AssertionError("an Embedding lookup should give an IndexedSlices gradient")
        if form == "dense":
            gradient = tf.convert_to_tensor(gradient)
        elif form == "deduplicated":
            gradient = deduplicate(gradient)
        optimizer.apply_gradients([(gradient, embedding.embeddings)])
    return embedding.embeddings.numpy()


@dataclasses.dataclass(frozen=True)
class SparseDenseRecord:
    """Max abs weight difference sparse-vs-dense and deduplicated-vs-dense, which rows
    differ, and the largest change the dense updates made (the scale of the difference)."""

    tokens: tuple
    sparse_vs_dense: float
    deduplicated_vs_dense: float
    rows_differing: tuple
    dense_update_max_abs: float


def reproduce(tokens=(1, 1, 2), optimizer_factory=lambda: keras.optimizers.Adam(0.1),
              steps: int = 2, vocab: int = 10, dim: int = 3) -> SparseDenseRecord:
    runs = {form: _train_embedding(list(tokens), form, optimizer_factory, steps, vocab, dim)
            for form in GRADIENT_FORMS}
    initial = _train_embedding(list(tokens), "dense", optimizer_factory, 0, vocab, dim)
    row_diff = np.abs(runs["sparse"] - runs["dense"]).max(axis=1)
    return SparseDenseRecord(
        tokens=tuple(tokens),
        sparse_vs_dense=float(row_diff.max()),
        deduplicated_vs_dense=float(np.abs(runs["deduplicated"] - runs["dense"]).max()),
        rows_differing=tuple(int(i) for i in np.nonzero(row_diff > 0)[0]),
        dense_update_max_abs=float(np.abs(runs["dense"] - initial).max()),
    )
