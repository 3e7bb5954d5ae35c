"""Dual-clip PPO loss: exact values, clipping, mask isolation, step-0 parity."""

import pytest
import torch

from nano_miles.algo.loss import LossConfig, ppo_loss

CFG = LossConfig(eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0)


def one_token(logp, old, adv):
    return ppo_loss(torch.tensor([[logp]]), torch.tensor([[old]]), torch.tensor([[adv]]),
                    torch.tensor([[True]]), CFG)


def test_step0_ratio_one_no_clipping():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    out = ppo_loss(logp, logp.clone(), torch.tensor([[1.0, -2.0, 0.5]]), torch.ones(1, 3, dtype=torch.bool))
    assert out.clip_fraction == 0.0 and out.dual_clip_fraction == 0.0 and out.parity == 0.0
    assert out.loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)


@pytest.mark.parametrize("log_ratio, adv, expected, clipped", [
    (0.1, 1.0, -torch.exp(torch.tensor(0.1)).item(), False),     # inside the trust region
    (0.5, 1.0, -1.28, True),                                       # A > 0: capped at 1 + eps_high
    (-0.5, 1.0, -torch.exp(torch.tensor(-0.5)).item(), False),    # A > 0, ratio low: unclipped term is larger
    (-0.5, -1.0, 0.8, True),                                       # A < 0, ratio low: floor 1 - eps
    (0.5, -1.0, torch.exp(torch.tensor(0.5)).item(), False),      # A < 0, ratio high: unclipped
    (2.0, -1.0, 3.0, False),                                       # A < 0, huge ratio: dual clip caps at c
])
def test_clipping_cases(log_ratio, adv, expected, clipped):
    out = one_token(-1.0 + log_ratio, -1.0, adv)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.clip_fraction == (1.0 if clipped else 0.0)
    assert out.dual_clip_fraction == (1.0 if log_ratio == 2.0 else 0.0)


def test_masked_positions_cannot_change_the_loss():
    mask = torch.tensor([[True, True, False, False]])
    logp = torch.tensor([[-1.0, -0.5, -3.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -1.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    base = ppo_loss(logp, old, adv, mask)
    nasty_logp = torch.tensor([[-1.0, -0.5, 1e30, float("nan")]], requires_grad=True)
    nasty_old = torch.tensor([[-1.1, -0.4, float("-inf"), float("nan")]])
    nasty_adv = torch.tensor([[1.0, -1.0, 1e30, float("inf")]])
    out = ppo_loss(nasty_logp, nasty_old, nasty_adv, mask)
    assert torch.isfinite(out.loss) and out.loss.item() == base.loss.item()
    assert out.parity == pytest.approx(base.parity) and out.num_tokens == 2
    out.loss.backward()
    assert torch.isfinite(nasty_logp.grad).all() and nasty_logp.grad[0, 2:].abs().sum() == 0


def test_extreme_log_ratio_is_clamped():
    out = one_token(100.0, -100.0, 1.0)  # log-ratio 200 would overflow exp without the clamp
    assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx(-1.28)


def test_gradient_pushes_logprob_along_advantage():
    for adv in (1.0, -1.0):
        logp = torch.tensor([[-1.0]], requires_grad=True)
        ppo_loss(logp, torch.tensor([[-1.0]]), torch.tensor([[adv]]), torch.tensor([[True]])).loss.backward()
        assert torch.sign(-logp.grad).item() == adv  # descent raises logp iff A > 0


def test_parity_measures_engine_gap():
    logp = torch.tensor([[-1.0, -2.0]])
    out = ppo_loss(logp, logp, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                   engine_logp=torch.tensor([[-1.5, -2.0]]))
    assert out.parity == pytest.approx(0.25)


def test_config_validation():
    with pytest.raises(AssertionError):
        LossConfig(dual_clip_c=0.5)


def test_truncated_is_weights():
    from nano_miles.algo.loss import truncated_is_weights
    old = torch.tensor([[-1.0, -1.0, -1.0, 5.0]])
    engine = torch.tensor([[-1.0, -2.0, -0.5, float("nan")]])
    mask = torch.tensor([[True, True, True, False]])
    w = truncated_is_weights(old, engine, mask, clip=2.0)
    assert w[0, 0].item() == 1.0 and w[0, 1].item() == pytest.approx(2.0)  # e^1 truncated at 2
    assert w[0, 2].item() == pytest.approx(torch.exp(torch.tensor(-0.5)).item())
    assert w[0, 3].item() == 1.0  # off the mask: neutral, NaN cannot leak in
    logp = old.clone()
    base = ppo_loss(logp, old, torch.ones(1, 4), mask)
    weighted = ppo_loss(logp, old, torch.ones(1, 4), mask, is_weights=w)
    assert weighted.loss.item() == pytest.approx(base.loss.item() * w[0, :3].mean().item())
