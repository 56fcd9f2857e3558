"""`distgrad.normalization`, the token-count helpers: `token_loss` divides the masked sum of
per-token losses by the count it is given, refuses a count that is not positive, and
`count_tokens` counts the mask's ones.
"""

import pytest
import tensorflow as tf

from distgrad.normalization import count_tokens, token_loss


def test_token_loss_divides_the_masked_sum_by_the_given_count():
    loss = tf.constant([[1.0, 2.0, 100.0]])
    mask = tf.constant([[1.0, 1.0, 0.0]])
    assert float(token_loss(loss, mask, 4.0)) == pytest.approx(0.75)
    assert float(count_tokens(mask)) == 2.0
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        token_loss(loss, mask, 0.0)
