"""Patience rule of early stopping (the broadcast is exercised in the torchrun tests)."""

import math

from elastic_runner.config import EarlyStoppingConfig
from elastic_runner.train.early_stop import EarlyStopping


def run(values, **kw):
    es = EarlyStopping(EarlyStoppingConfig(enabled=True, **kw))
    decisions = [es.update(v, step=i) for i, v in enumerate(values)]
    return es, decisions


def test_min_mode_stops_after_patience_evals_without_improvement():
    es, d = run([1.0, 0.8, 0.85, 0.81, 0.9], mode="min", patience=3)
    assert [x.improved for x in d] == [True, True, False, False, False]
    assert [x.stop for x in d] == [False, False, False, False, True]
    assert (es.best, es.best_step) == (0.8, 1)


def test_min_delta_and_max_mode():
    es, d = run([0.5, 0.505, 0.52], mode="max", patience=5, min_delta=0.01)
    assert [x.improved for x in d] == [True, False, True]
    assert es.bad_evals == 0


def test_nan_never_improves_and_state_round_trips():
    es, d = run([math.nan, 1.0, math.nan], mode="min", patience=2)
    assert [x.improved for x in d] == [False, True, False]
    other = EarlyStopping(EarlyStoppingConfig(enabled=True, patience=2))
    other.load_state_dict(es.state_dict())
    assert other.update(math.nan, 9).stop


def test_disabled_never_stops():
    es = EarlyStopping(EarlyStoppingConfig(enabled=False, patience=1))
    assert not any(es.update(1.0, i).stop for i in range(5))
