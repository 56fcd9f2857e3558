"""`MicroBatchingModel` on hand-computed values: two `fit` steps of a one-weight model whose
gradient is the same whole or in k = 2 micro-batches, with the weight, the logged loss and
`iterations` after them; with `non_finite="skip"`, a step with a NaN target dropped,
counted in `fit`'s logs, and the next one applied.
"""

import keras
import numpy as np

from distgrad.train_step import MicroBatchingModel


def test_micro_batching_fit_call_by_call():
    # loss = mean((w x)^2) over x = 1..4; dloss/dw = 2 w mean(x^2) = 15 w. With k = 2
    # slices: (2 w (1 + 4) / 2 + 2 w (9 + 16) / 2) / 2 = 15 w, the same.
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs)
    model = MicroBatchingModel(inputs, outputs, accumulation_steps=2)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.array([[1.0], [2.0], [3.0], [4.0]], "float32")
    history = model.fit(x, np.zeros_like(x), batch_size=4, epochs=2, shuffle=False, verbose=0)
    # step 1: w = 1 - 0.1 * 15 = -0.5; step 2: w = -0.5 - 0.1 * 15 * -0.5 = 0.25
    np.testing.assert_allclose(model.get_weights()[0], [[0.25]], rtol=1e-6)
    np.testing.assert_allclose(history.history["loss"], [7.5, 1.875], rtol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 2


# -- non-finite gradients -----------------------------------------------------------------


def test_micro_batching_skip_call_by_call():
    # Two steps on x = 1..4: the first has a NaN target and is skipped, the second is the
    # step of test_micro_batching_fit_call_by_call: w = 1 - 0.1 * 15 * 1 = -0.5.
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs)
    model = MicroBatchingModel(inputs, outputs, accumulation_steps=2, non_finite="skip")
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.array([[1.0], [2.0], [3.0], [4.0]] * 2, "float32")
    y = np.zeros_like(x)
    y[0] = np.nan
    history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    np.testing.assert_allclose(model.get_weights()[0], [[-0.5]], rtol=1e-6)
    assert history.history["skipped_updates"] == [1]
    assert int(model.optimizer.iterations.numpy()) == 1
