"""The sizes the no-merge-call specs share (a helper module, no tests): the accumulation
steps, the global micro-batch, the updates, and the weights of `tiny_model`, which one
packed gradient all-reduce moves. The strategy itself is conftest's `no_merge_call`.
"""

K, MICRO, UPDATES = 2, 4, 3  # MICRO: the global micro-batch
PARAMETERS = 4 * 8 + 8 + 8 * 1 + 1  # tiny_model's weights: one packed gradient all-reduce
