"""Advantage estimators against plain-Python arithmetic: grpo (group / batch / no scaling), rloo,
reinforce_pp, and the zero-variance guard that means the same for each.

Run: `pytest tests/test_advantages.py`.
"""

import math

import numpy as np
import pytest
import torch

from nano_miles.algo.advantages import ESTIMATORS, ZERO_STD, estimate, has_signal

# groups of different sizes, a zero-variance group, negative and fractional rewards
STEP = [[1.0, 0.0, 0.0, 1.0], [0.1, 0.5, 0.9, 0.9, -0.4], [0.7, 0.7, 0.7], [2.0, -1.0]]


def mean(xs):
    return sum(xs) / len(xs)


def pstd(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def flat(groups):
    return [x for g in groups for x in g]


def close(got, want, tol=2e-6):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [round(float(x), 9) for x in g] == pytest.approx(w, abs=tol), (g, w)


def test_grpo_group_scaling_is_whitening_inside_each_group():
    want = [[(x - mean(g)) / (pstd(g) + 1e-6) for x in g] if pstd(g) >= ZERO_STD else [0.0] * len(g) for g in STEP]
    close(estimate("grpo", STEP), want)


def test_grpo_batch_scaling_divides_by_the_std_of_every_reward_of_the_step():
    s = pstd(flat(STEP)) + 1e-6
    want = [[(x - mean(g)) / s for x in g] if pstd(g) >= ZERO_STD else [0.0] * len(g) for g in STEP]
    close(estimate("grpo", STEP, "batch"), want)


def test_grpo_without_scaling_is_dr_grpos_mean_subtraction():
    want = [[x - mean(g) for x in g] if pstd(g) >= ZERO_STD else [0.0] * len(g) for g in STEP]
    close(estimate("grpo", STEP, "none"), want)


def test_rloo_subtracts_the_mean_of_the_other_samples():
    want = []
    for g in STEP:
        others = [mean(g[:i] + g[i + 1:]) for i in range(len(g))]
        want.append([x - o for x, o in zip(g, others)] if pstd(g) >= ZERO_STD else [0.0] * len(g))
    close(estimate("rloo", STEP), want)
    # a sample's baseline ignores its own reward: raising it moves no other sample of the group above
    higher = estimate("rloo", [[1.0, 0.0, 0.0, 5.0]])[0]
    assert higher[3] == pytest.approx(5.0 - 1 / 3) and higher[0] == pytest.approx(1.0 - 5 / 3)


def test_reinforce_pp_normalizes_group_centered_rewards_over_the_step():
    centered = flat([[x - mean(g) for x in g] for g in STEP])
    m, s = mean(centered), pstd(centered) + 1e-6
    want, i = [], 0
    for g in STEP:
        row = [(c - m) / s for c in centered[i:i + len(g)]]
        want.append(row if pstd(g) >= ZERO_STD else [0.0] * len(g))
        i += len(g)
    close(estimate("reinforce_pp", STEP), want)


@pytest.mark.parametrize("name,scale", [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"),
                                        ("rloo", "group"), ("reinforce_pp", "group")])
def test_a_group_without_signal_gets_exact_zeros_under_every_estimator(name, scale):
    one = np.float32(1.0)
    up = np.nextafter(one, np.float32(2.0))  # a spread of one ulp: float noise, not signal
    step = [[0.3, 0.3, 0.3], [one, up, one], [5.0], [0.0, 1.0, 1.0]]
    out = estimate(name, step, scale)
    for group in out[:3]:
        assert torch.equal(group, torch.zeros_like(group))
    assert out[3].abs().min() > 0.1  # the group with signal keeps it
    assert [has_signal(g) for g in step] == [False, False, False, True]
    assert all(a.dtype == torch.float32 for a in out)


def test_group_scaling_keeps_the_arithmetic_the_project_always_used():
    """float64 whitening of a (1, G) row with eps 1e-6, then float32: the advantages every earlier
    run trained on, bit for bit."""
    rng = np.random.default_rng(0)
    rewards = rng.uniform(-1, 2, size=(6, 8)).astype(np.float32)
    row = torch.from_numpy(rewards).to(torch.float64)
    mean_, std_ = row.mean(dim=1, keepdim=True), row.std(dim=1, keepdim=True, unbiased=False)
    want = ((row - mean_) / (std_ + 1e-6)).to(torch.float32)
    got = torch.stack(estimate("grpo", list(rewards)))
    assert torch.equal(got, want)


def test_unknown_names_and_empty_groups_are_refused():
    with pytest.raises(ValueError, match="one of"):
        estimate("ppo", STEP)
    with pytest.raises(ValueError, match="scale"):
        estimate("grpo", STEP, "token")
    with pytest.raises(ValueError, match="no scale"):
        estimate("rloo", STEP, "none")
    with pytest.raises(ValueError, match="at least one"):
        estimate("grpo", [[1.0], []])
    assert set(ESTIMATORS) == {"grpo", "rloo", "reinforce_pp"}
