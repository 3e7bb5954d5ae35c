"""Every policy loss against plain-Python arithmetic (value and gradient), micro-batches that add up to the
whole batch, finite losses and gradients whatever an engine reports, and KL / entropy terms that pull the
right way.

Run: `pytest tests/test_loss_variants.py`.
"""

import math

import pytest
import torch

from nano_miles.algo.loss import KL_ESTIMATORS, LOSSES, LossConfig, StepTotals, kl_terms, policy_loss, unusable_logprobs

EPS, EPS_HIGH, C, MAX_NEW = 0.2, 0.28, 3.0, 8
WIDTH = 7
# per row: (advantage, [log-ratio of each response token], offset of the first response token in the row);
# ratios on both sides of each clip, positive and negative advantages, rows of 4, 1, 3 and 2 tokens,
# prompt positions before them and padding after (off the mask)
ROWS = [(1.0, [0.1, 0.5, -0.5, 0.0], 1),
        (-2.0, [2.0], 3),
        (-0.5, [-0.5, 0.2, 0.05], 2),
        (0.7, [-0.3, 0.4], 0)]


def clip(x, low, high):
    return min(max(x, low), high)


def ppo_token(rho, a, dual=True):
    """One token's clipped PPO term and its derivative by log pi (d rho / d log pi = rho)."""
    unclipped, clipped = -rho * a, -clip(rho, 1 - EPS, 1 + EPS_HIGH) * a
    value, grad = (clipped, 0.0) if clipped > unclipped else (unclipped, -rho * a)
    if dual and a < 0 and value > -C * a:
        value, grad = -C * a, 0.0
    return value, grad


def reference(name):
    """(loss, {(row, position): d loss / d log pi}) in plain floats."""
    num_tokens = sum(len(r) for _, r, _ in ROWS)
    num_samples = len(ROWS)
    loss, grads = 0.0, {}
    for i, (a, ratios, start) in enumerate(ROWS):
        n = len(ratios)
        if name in ("gspo", "gspo_token"):
            s = math.exp(sum(ratios) / n)
            value, grad = ppo_token(s, a, dual=False)  # per sample; d s / d log pi_t = s / n
            loss += value / num_samples
            for j in range(n):
                grads[(i, start + j)] = grad / n / num_samples
            continue
        for j, lr in enumerate(ratios):
            rho = math.exp(lr)
            if name == "cispo":
                logp = old(i, start + j) + lr
                weight = min(rho, 1 + EPS_HIGH)
                value, grad = -weight * a * logp, -weight * a
            else:
                value, grad = ppo_token(rho, a)
            divisor = {"dapo": num_tokens, "cispo": num_tokens, "grpo": n * num_samples,
                       "dr_grpo": num_samples * MAX_NEW}[name]
            loss += value / divisor
            grads[(i, start + j)] = grad / divisor
    return loss, grads


def old(i, t):
    return -0.25 * (t + 1) - 0.1 * i


def batch(rows=ROWS):
    """(logp, old, adv, mask) with finite junk off the mask that would change every figure if it leaked in."""
    logp, old_logp = torch.full((len(rows), WIDTH), 5.0), torch.full((len(rows), WIDTH), -1.0)
    adv, mask = torch.full((len(rows), WIDTH), 7.0), torch.zeros(len(rows), WIDTH, dtype=torch.bool)
    for i, (a, ratios, start) in enumerate(rows):
        for j, lr in enumerate(ratios):
            t = start + j
            old_logp[i, t], logp[i, t], adv[i, t], mask[i, t] = old(i, t), old(i, t) + lr, a, True
    return logp.requires_grad_(True), old_logp, adv, mask


def config(name, **kw):
    return LossConfig(eps_clip=EPS, eps_clip_high=EPS_HIGH, dual_clip_c=C, name=name, max_new_tokens=MAX_NEW, **kw)


@pytest.mark.parametrize("name", LOSSES)
def test_each_loss_and_its_gradient_are_the_formula(name):
    logp, old_logp, adv, mask = batch()
    out = policy_loss(logp, old_logp, adv, mask, config(name))
    out.loss.backward()
    want, want_grads = reference(name)
    assert out.loss.item() == pytest.approx(want, rel=1e-5)
    for i in range(len(ROWS)):
        for t in range(WIDTH):
            assert logp.grad[i, t].item() == pytest.approx(want_grads.get((i, t), 0.0), rel=1e-5, abs=1e-7), (i, t)


def test_the_aggregations_really_differ_on_this_batch():
    values = {name: reference(name)[0] for name in LOSSES if name != "gspo_token"}  # gspo's value, by design
    assert len({round(v, 4) for v in values.values()}) == len(values), values


def test_gspo_token_has_gspos_value_and_gradient_and_gspo_clips_per_sample():
    grads = {}
    for name in ("gspo", "gspo_token"):
        logp, old_logp, adv, mask = batch()
        out = policy_loss(logp, old_logp, adv, mask, config(name))
        out.loss.backward()
        grads[name] = (out.loss.item(), logp.grad.clone(), out.means)
    assert grads["gspo"][0] == pytest.approx(grads["gspo_token"][0], rel=1e-6)
    assert torch.allclose(grads["gspo"][1], grads["gspo_token"][1], atol=1e-7)
    means = grads["gspo"][2]
    # per-sample ratios exp(mean log-ratio): 1.027, 7.39 (A < 0: unclipped), 0.905, 1.051: none bind here
    assert means.clip_fraction == 0.0 and means.ratio_max == pytest.approx(math.exp(2.0), rel=1e-6)
    # a sample whose mean log-ratio is past the ceiling with A > 0 is clipped as a whole
    logp, old_logp, adv, mask = batch([(1.0, [0.6, 0.2], 0), (1.0, [0.0, 0.1], 0)])
    out = policy_loss(logp, old_logp, adv, mask, config("gspo"))
    out.loss.backward()
    assert out.means.clip_high_fraction == pytest.approx(0.5) and out.means.clip_low_fraction == 0.0
    assert (logp.grad[0] == 0).all() and (logp.grad[1, :2] != 0).all()


def test_clip_sides_are_counted_apart():
    logp, old_logp, adv, mask = batch()
    m = policy_loss(logp, old_logp, adv, mask, config("dapo")).means
    # high: A > 0 at log-ratios 0.5 and 0.4 (past log 1.28); low: A = -0.5 at -0.5 (below log 0.8);
    # A > 0 at a low ratio and A < 0 at a high one are not clipped; the dual cap is counted apart
    assert (m.clip_high_fraction, m.clip_low_fraction) == pytest.approx((2 / 10, 1 / 10))
    assert m.clip_fraction == pytest.approx(3 / 10) and m.dual_clip_fraction == pytest.approx(1 / 10)
    assert m.ratio_mean == pytest.approx(sum(math.exp(x) for _, r, _ in ROWS for x in r) / 10, rel=1e-6)
    c = policy_loss(logp, old_logp, adv, mask, config("cispo")).means
    assert (c.clip_high_fraction, c.clip_low_fraction) == pytest.approx((3 / 10, 0.0))  # weights truncated


@pytest.mark.parametrize("name", LOSSES)
def test_micro_batches_given_the_steps_totals_add_up_to_the_whole_batch(name):
    logp, old_logp, adv, mask = batch()
    ref = torch.full_like(logp, -1.5)
    entropy = torch.rand(logp.shape, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    cfg = config(name, kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
    whole = policy_loss(logp, old_logp, adv, mask, cfg, ref_logp=ref, entropy=entropy)
    whole.loss.backward()
    whole_grad, whole_entropy_grad = logp.grad.clone(), entropy.grad.clone()
    logp.grad, entropy.grad = None, None
    totals = StepTotals(num_tokens=int(mask.sum()), num_samples=len(ROWS))
    total = 0.0
    for rows in ([0, 2], [1, 3]):
        part = policy_loss(logp[rows], old_logp[rows], adv[rows], mask[rows], cfg, totals, ref_logp=ref[rows],
                           entropy=entropy[rows])
        part.loss.backward()
        total += part.loss.item()
    assert total == pytest.approx(whole.loss.item(), rel=1e-6)
    assert torch.allclose(logp.grad, whole_grad, atol=1e-7) and torch.allclose(entropy.grad, whole_entropy_grad)


NASTY = [float("-inf"), -3.4028234663852886e38, float("nan"), float("inf"), 60.0, -60.0]


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("name", LOSSES)
def test_whatever_an_engine_reports_the_loss_and_its_gradient_stay_finite(name, estimator):
    """Behaviour and engine log-probs of -inf, the most negative float32, NaN, +inf and log-ratios of
    +-60 (ratios of 1e26 and 1e-26) on tokens in the loss; the reference log-probs as bad."""
    logp, old_logp, adv, mask = batch()
    positions = [(0, 1), (0, 2), (0, 3), (2, 2), (2, 3), (3, 0)]
    engine, ref = old_logp.clone(), torch.full_like(old_logp, -1.0)
    for (i, t), bad in zip(positions, NASTY):
        old_logp[i, t] = bad if abs(bad) != 60.0 else logp[i, t].item() - bad
        engine[i, t], ref[i, t] = bad, NASTY[(NASTY.index(bad) + 1) % len(NASTY)]
    from nano_miles.algo.loss import truncated_is_weights
    weights = truncated_is_weights(old_logp, engine, mask, 2.0)
    entropy = torch.full(logp.shape, 1.0, requires_grad=True)
    out = policy_loss(logp, old_logp, adv, mask, config(name, kl_coef=0.1, kl_estimator=estimator, entropy_coef=0.01),
                      engine_logp=engine, is_weights=weights, ref_logp=ref, entropy=entropy)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all() and torch.isfinite(entropy.grad).all()
    assert torch.isfinite(weights).all() and (weights <= 2.0).all()
    means = out.means
    assert all(math.isfinite(v) for v in (means.clip_fraction, means.ratio_mean, means.ratio_max, means.parity,
                                          means.kl, means.entropy))


def test_unusable_engine_logprobs_are_named():
    assert unusable_logprobs(torch.tensor([-0.5, -12.0, -300.0])) is None
    assert unusable_logprobs(torch.tensor([-0.5, float("nan")])) == "nonfinite_logprob"
    assert unusable_logprobs(torch.tensor([float("-inf")])) == "nonfinite_logprob"
    assert unusable_logprobs(torch.tensor([-1.0, -3.4028234663852886e38])) == "impossible_logprob"


@pytest.mark.parametrize("estimator, sides", [("k1", (1.0,)), ("k2", (1.0, -1.0)), ("k3", (1.0, -1.0))])
def test_a_step_on_each_kl_penalty_moves_log_pi_toward_the_reference(estimator, sides):
    """k2 and k3 pull a token's log-prob toward the reference's from either side. k1's gradient is 1 per
    sampled token: it only pushes sampled tokens down, which is toward the reference where the policy
    rose above it (the side that matters for tokens the policy samples); it is meant for the reward."""
    for side in sides:
        ref = torch.tensor([[-2.0, -1.0, -3.0]])
        logp = (ref + side * torch.tensor([[0.5, 1.0, 0.2]])).requires_grad_(True)
        mask = torch.ones(1, 3, dtype=torch.bool)
        out = policy_loss(logp, logp.detach(), torch.zeros(1, 3), mask, config("dapo", kl_coef=1.0,
                                                                                   kl_estimator=estimator), ref_logp=ref)
        out.loss.backward()
        stepped = logp.detach() - 0.1 * logp.grad
        assert ((stepped - ref).abs() < (logp.detach() - ref).abs()).all(), (estimator, side)
        assert out.means.kl == pytest.approx(float(kl_terms(logp.detach(), ref, mask, estimator).mean()))


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_minimizing_the_kl_penalty_on_sampled_tokens_brings_the_distribution_to_the_reference(estimator):
    """A categorical policy over 6 tokens, 4,000 tokens drawn from it, a few gradient steps on the
    penalty alone: the exact KL(pi || pi_ref) over the vocabulary falls."""
    gen = torch.Generator().manual_seed(0)
    ref_all = torch.log_softmax(torch.randn(6, generator=gen), -1)
    theta = torch.randn(6, generator=gen).mul(2).requires_grad_(True)

    def exact_kl():
        p = torch.log_softmax(theta.detach(), -1)
        return float((p.exp() * (p - ref_all)).sum())
    start = exact_kl()
    for _ in range(20):
        logp_all = torch.log_softmax(theta, -1)
        tokens = torch.multinomial(logp_all.exp().detach(), 4000, replacement=True, generator=gen)[None, :]
        logp = logp_all[tokens]
        mask = torch.ones_like(tokens, dtype=torch.bool)
        out = policy_loss(logp, logp.detach(), torch.zeros_like(logp), mask,
                          config("dapo", kl_coef=1.0, kl_estimator=estimator), ref_logp=ref_all[tokens])
        theta.grad = None
        out.loss.backward()
        with torch.no_grad():
            theta -= 0.5 * theta.grad
    assert exact_kl() < 0.5 * start, (start, exact_kl())


def test_the_entropy_bonus_raises_entropy():
    theta = torch.tensor([3.0, 0.5, -1.0, -2.0], requires_grad=True)

    def entropy_of(t):
        p = torch.log_softmax(t, -1)
        return -(p.exp() * p).sum()
    start = float(entropy_of(theta.detach()))
    for _ in range(10):
        ent = entropy_of(theta).expand(1, 5)  # the distribution's entropy at each of 5 positions
        logp = torch.log_softmax(theta, -1)[torch.zeros(1, 5, dtype=torch.long)]
        out = policy_loss(logp, logp.detach(), torch.zeros(1, 5), torch.ones(1, 5, dtype=torch.bool),
                          config("dapo", entropy_coef=1.0), entropy=ent)
        theta.grad = None
        out.loss.backward()
        with torch.no_grad():
            theta -= 0.5 * theta.grad
    assert float(entropy_of(theta.detach())) > start + 0.3
