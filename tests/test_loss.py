"""Dual-clip PPO loss: exact values, clipping, mask isolation, step-0 parity."""

import math

import pytest
import torch

from nano_miles.algo.loss import LossConfig, policy_loss

CFG = LossConfig(eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0)


def one_token(logp, old, adv):
    return policy_loss(torch.tensor([[logp]]), torch.tensor([[old]]), torch.tensor([[adv]]),
                    torch.tensor([[True]]), CFG)


def test_step0_ratio_one_no_clipping():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    out = policy_loss(logp, logp.clone(), torch.tensor([[1.0, -2.0, 0.5]]), torch.ones(1, 3, dtype=torch.bool))
    assert out.means.clip_fraction == 0.0 and out.means.dual_clip_fraction == 0.0 and out.means.parity == 0.0
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
    assert out.means.clip_fraction == (1.0 if clipped else 0.0)
    assert out.means.dual_clip_fraction == (1.0 if log_ratio == 2.0 else 0.0)


def test_masked_positions_cannot_change_the_loss():
    mask = torch.tensor([[True, True, False, False]])
    logp = torch.tensor([[-1.0, -0.5, -3.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -1.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    base = policy_loss(logp, old, adv, mask)
    nasty_logp = torch.tensor([[-1.0, -0.5, 1e30, float("nan")]], requires_grad=True)
    nasty_old = torch.tensor([[-1.1, -0.4, float("-inf"), float("nan")]])
    nasty_adv = torch.tensor([[1.0, -1.0, 1e30, float("inf")]])
    out = policy_loss(nasty_logp, nasty_old, nasty_adv, mask)
    assert torch.isfinite(out.loss) and out.loss.item() == base.loss.item()
    assert out.means.parity == pytest.approx(base.means.parity) and out.num_tokens == 2
    out.loss.backward()
    assert torch.isfinite(nasty_logp.grad).all() and nasty_logp.grad[0, 2:].abs().sum() == 0


def test_extreme_log_ratio_is_clamped():
    out = one_token(100.0, -100.0, 1.0)  # log-ratio 200 would overflow exp without the clamp
    assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx(-1.28)


def test_gradient_pushes_logprob_along_advantage():
    for adv in (1.0, -1.0):
        logp = torch.tensor([[-1.0]], requires_grad=True)
        policy_loss(logp, torch.tensor([[-1.0]]), torch.tensor([[adv]]), torch.tensor([[True]])).loss.backward()
        assert torch.sign(-logp.grad).item() == adv  # descent raises logp iff A > 0


def test_parity_measures_engine_gap():
    logp = torch.tensor([[-1.0, -2.0]])
    out = policy_loss(logp, logp, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                   engine_logp=torch.tensor([[-1.5, -2.0]]))
    assert out.means.parity == pytest.approx(0.25)


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
    base = policy_loss(logp, old, torch.ones(1, 4), mask)
    weighted = policy_loss(logp, old, torch.ones(1, 4), mask, is_weights=w)
    assert weighted.loss.item() == pytest.approx(base.loss.item() * w[0, :3].mean().item())


def reference_pg(log_ratio: float, adv: float) -> tuple[float, bool, bool, float]:
    """One token of CFG's dual-clip loss in plain floats: (loss, clipped, dual-capped, d loss / d logp)."""
    rho = math.exp(log_ratio)
    unclipped = -rho * adv
    clipped = -min(max(rho, 1 - CFG.eps_clip), 1 + CFG.eps_clip_high) * adv
    value, grad = (clipped, 0.0) if clipped > unclipped else (unclipped, -rho * adv)
    is_dual = adv < 0 and value > -CFG.dual_clip_c * adv
    if is_dual:
        value, grad = -CFG.dual_clip_c * adv, 0.0
    return value, clipped > unclipped, is_dual, grad


def test_batch_loss_is_a_token_mean_over_rows_of_different_lengths():
    # per row: (advantage, [(log-ratio, IS weight) per response token], response offset in the row)
    rows = [(1.0, [(0.1, 1.0), (0.5, 0.5), (-0.5, 2.0), (0.0, 1.5)], 0),   # 4 tokens: inside, capped, low, ratio 1
            (-2.0, [(2.0, 0.8)], 2),                                         # 1 token: dual clip
            (-0.5, [(-0.5, 1.0), (0.2, 1.2)], 1)]                            # 2 tokens: floor, inside
    width = 5
    # off the mask: finite junk that would change every figure if it leaked in
    logp, old, adv = torch.full((3, width), 5.0), torch.full((3, width), -1.0), torch.full((3, width), 7.0)
    weights, mask = torch.full((3, width), 100.0), torch.zeros(3, width, dtype=torch.bool)
    total, num_clipped, num_dual, row_means = 0.0, 0, 0, []
    grads = torch.zeros(3, width, dtype=torch.float64)
    num_tokens = sum(len(tokens) for _, tokens, _ in rows)
    for i, (a, tokens, start) in enumerate(rows):
        row_sum = 0.0
        for j, (log_ratio, w) in enumerate(tokens):
            t = start + j
            old[i, t] = -0.25 * (t + 1)
            logp[i, t] = old[i, t] + log_ratio
            adv[i, t], weights[i, t], mask[i, t] = a, w, True
            value, is_clipped, is_dual, grad = reference_pg(log_ratio, a)
            row_sum += w * value
            num_clipped, num_dual = num_clipped + is_clipped, num_dual + is_dual
            grads[i, t] = w * grad / num_tokens
        total += row_sum
        row_means.append(row_sum / len(tokens))
    assert (num_tokens, num_clipped, num_dual) == (7, 2, 1)
    token_mean = total / num_tokens
    assert abs(token_mean - sum(row_means) / len(rows)) > 0.5  # the two ways of averaging really differ here
    logp.requires_grad_(True)
    out = policy_loss(logp, old, adv, mask, CFG, is_weights=weights)
    assert out.num_tokens == num_tokens
    assert out.loss.item() == pytest.approx(token_mean, rel=1e-5)
    assert out.means.clip_fraction == pytest.approx(num_clipped / num_tokens)
    assert out.means.dual_clip_fraction == pytest.approx(num_dual / num_tokens)
    out.loss.backward()
    assert torch.allclose(logp.grad.double(), grads, atol=1e-6)  # every token weighs 1 / num_tokens
