"""The version gate and the admission rules (`nano_miles/algo/admission.py`), each on its own."""

import pytest

from nano_miles.algo.admission import (DUPLICATE, FUTURE, NO_SIGNAL, STALE, refusal, staleness,
                                       version_allows)


def admit(step=5, oldest=4, newest=4, consumed=False, max_staleness=0, signal=True, skip=False):
    return refusal(step, oldest_version=oldest, newest_version=newest, is_consumed=consumed,
                   max_staleness=max_staleness, has_signal=signal, skip_zero_variance=skip)


def test_staleness_counts_versions_behind_the_weights_the_step_trains():
    assert staleness(step=5, oldest_version=4) == 0  # step 5 trains on version 4: on-policy
    assert staleness(step=5, oldest_version=2) == 2
    assert staleness(step=1, oldest_version=0) == 0


def test_an_on_policy_group_is_admitted_and_a_bounded_stale_one_too():
    assert admit() is None
    assert admit(oldest=2, max_staleness=2) is None
    assert admit(oldest=2, newest=4, max_staleness=2) is None  # resumed across two updates


def test_each_rule_refuses_with_its_reason():
    assert admit(consumed=True) == DUPLICATE
    assert admit(newest=5) == FUTURE  # weights the step does not have yet: rolled back by a restart
    assert admit(oldest=3) == STALE
    assert admit(oldest=1, max_staleness=2) == STALE
    assert admit(signal=False, skip=True) == NO_SIGNAL
    assert admit(signal=False, skip=False) is None  # without dynamic sampling it trains (advantages 0)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(consumed=True, newest=9, oldest=0, signal=False, skip=True), DUPLICATE),  # dropped for good first
    (dict(newest=9, oldest=0, signal=False, skip=True), FUTURE),
    (dict(oldest=0, signal=False, skip=True), STALE),
])
def test_the_first_rule_that_applies_wins(kwargs, reason):
    assert admit(**kwargs) == reason


def test_the_gate_bounds_the_groups_on_their_way_by_steps_and_versions():
    # sync (staleness 0), 4 groups a step: with version v served and v steps trained, one batch is out
    assert [version_allows(out, 0, 0, 4, 0) for out in range(6)] == [True] * 4 + [False] * 2
    assert version_allows(3, 1, 1, 4, 0) and not version_allows(4, 1, 1, 4, 0)
    assert not version_allows(0, 1, 2, 4, 0)  # step 2 trained, its weights not served yet: nothing starts
    assert version_allows(7, 1, 1, 4, 1) and not version_allows(8, 1, 1, 4, 1)  # one version ahead
    assert version_allows(3, 1, 2, 4, 1) and not version_allows(4, 1, 2, 4, 1)
    assert not version_allows(0, -1, 0, 4, 2)  # no weights served yet: nothing starts
    # steps, not groups trained so far: 5 steps of 8 groups, then 4 a step after a restart
    assert version_allows(3, 5, 5, 4, 0) and not version_allows(4, 5, 5, 4, 0)
