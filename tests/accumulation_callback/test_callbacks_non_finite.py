"""`AccumulationCallback` and skipped updates: with `non_finite="skip"` on two replicas the
callback puts the running count of skipped updates in `fit`'s logs after each epoch, and
the optimizer warns of the updates a `fit` skipped, with the callback or without it.
"""

import pytest
from non_finite_cases import MICRO, K, compiled, nan_data

from distgrad.callbacks import AccumulationCallback
from distgrad.optimizer import AccumulatingOptimizer
from distgrad_course.lab.compare import OPTIMIZERS


def test_the_callback_puts_skipped_updates_in_fit_logs_and_the_optimizer_warns(strategy2):
    x, y = nan_data(strategy2)
    model = compiled(strategy2, lambda: AccumulatingOptimizer(OPTIMIZERS["sgd"](), K,
                                                              non_finite="skip"))
    with pytest.warns(UserWarning, match=r"2 update\(s\) skipped in this fit \(2 in all"):
        history = model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
                            callbacks=[AccumulationCallback()])
    assert history.history["skipped_updates"] == [1, 2]
    with pytest.warns(UserWarning, match=r"1 update\(s\) skipped in this fit \(3 in all"):
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)  # no callback
