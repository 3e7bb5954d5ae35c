"""The benchmarks' verdicts: "met" or "missed by X" in the target's unit, and the spread over seeds."""

import pytest

from harness.verdict import Spread, Verdict


def test_a_missed_target_says_by_how_much_in_its_unit():
    v = Verdict("shm vs disk", 2.4, ">=", 20, "x")
    assert not v.is_met and v.missed_by == pytest.approx(17.6)
    assert v.text == "missed by 17.6x"
    assert v.line() == "shm vs disk: 2.4x (target >= 20.0x): missed by 17.6x"
    over = Verdict("flat p50", 9.25, "<=", 8.0, "ms", 2)
    assert over.text == "missed by 1.25 ms"
    assert over.to_json()["missed_by"] == pytest.approx(1.25) and over.to_json()["is_met"] is False


def test_a_met_target_and_its_edge():
    assert Verdict("gain", 30.0, ">=", 30.0, "points").text == "met"
    assert Verdict("overhead", 1.36, "<=", 2.0, "%", 2).line() == "overhead: 1.36% (target <= 2.00%): met"
    assert Verdict("overhead", 2.01, "<=", 2.0, "%", 2).text == "missed by 0.01%"


def test_nothing_measured_is_a_miss_that_says_why():
    v = Verdict("time to target", None, "<=", 0.8, "x", why_none="not reached by every seed")
    assert not v.is_met and v.missed_by is None
    assert v.text == "missed (not reached by every seed)"
    assert Verdict("nan", float("nan"), ">=", 1).text == "missed (not reached)"
    with pytest.raises(ValueError):
        Verdict("bad", 1.0, ">", 1.0)


def test_spread_over_seeds_has_no_mean_when_a_seed_never_got_there():
    s = Spread.of([30.0, 10.0, 20.0])
    assert (s.mean, s.min, s.max, s.std, s.num, s.num_missing) == (20.0, 10.0, 30.0, 10.0, 3, 0)
    assert s.text(".0f") == "20 [10, 30]"
    partial = Spread.of([40.0, None])
    assert partial.mean is None and (partial.min, partial.max, partial.num_missing) == (40.0, 40.0, 1)
    assert partial.text(".0f") == "- [40, 40] (1 of 2 missing)"
    assert Spread.of([0.25]).std == 0.0 and Spread.of([None]).text() == "- [-, -] (1 of 1 missing)"
