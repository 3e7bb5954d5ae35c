"""The learner's step as a whole: the default update is the one this trainer always took (bit for bit),
several passes and mini-batches are what they say, a gradient that is not finite never reaches the
weights, truncated and unusable samples train nothing, and KL as a reward penalty lands in the advantages.

Run: `pytest tests/test_learner_updates.py` (the shipped small policy on CPU, fp32).
"""

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from nano_miles.algo.grpo import assemble_batch, token_scores
from nano_miles.run.sections import TrainerConfig
from nano_miles.stages.trainer.learner import Learner, TrainSample

TEMPERATURE = 0.8


@pytest.fixture
def policy(policy_dir):
    return lambda: AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)


def make_samples(num: int, seed: int = 0, group_size: int = 4) -> list[TrainSample]:
    """Samples of different lengths in groups of `group_size`, rewards in [0, 1] (float32, as on the wire)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        response = rng.integers(3, 260, size=int(rng.integers(2, 30)))
        out.append(TrainSample(rng.integers(3, 260, size=int(rng.integers(4, 16))), response,
                               -rng.uniform(0.1, 4.0, size=len(response)).astype(np.float32),
                               float(np.float32(rng.uniform(0, 1))), i // group_size))
    return out


def learner_for(model, **overrides) -> Learner:
    return Learner(TrainerConfig(**overrides), model, pad_id=0, temperature=TEMPERATURE, max_new_tokens=30)


def same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def todays_update(model, samples):
    """The update this trainer took before it had variants, written out: float64 group whitening,
    token-mean dual-clip PPO (clip 0.2 / 0.28, c = 3) over the whole batch, one AdamW step at lr 1e-4
    after clipping the gradient norm to 1."""
    advantages = []
    for g in sorted({s.group for s in samples}):
        row = torch.tensor([[s.reward for s in samples if s.group == g]], dtype=torch.float32).to(torch.float64)
        mean, std = row.mean(dim=1, keepdim=True), row.std(dim=1, keepdim=True, unbiased=False)
        adv = torch.where(std < 1e-7, torch.zeros_like(row), (row - mean) / (std + 1e-6)).to(torch.float32)
        advantages += [float(a) for a in adv[0]]
    batch = assemble_batch([s.prompt for s in samples], [s.response for s in samples],
                           [s.logprobs for s in samples], advantages, pad_id=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logp, _ = token_scores(model, batch.input_ids, batch.targets, batch.attention_mask, TEMPERATURE,
                           positions=batch.loss_mask, with_entropy=True)
    mask, zeros = batch.loss_mask, torch.zeros_like(batch.old_logprobs)
    old, adv = torch.where(mask, batch.old_logprobs, zeros), torch.where(mask, batch.advantages, zeros)
    ratio = torch.exp(torch.clamp(torch.where(mask, logp, old) - old, -20.0, 20.0))
    pg = torch.maximum(-ratio * adv, -torch.clamp(ratio, 1 - 0.2, 1 + 0.28) * adv)
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg)
    (torch.where(mask, pg, zeros).sum() / int(mask.sum())).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return advantages


def test_the_default_step_is_the_update_this_trainer_always_took_bit_for_bit(policy):
    samples = make_samples(12)
    mine, theirs = policy(), policy()
    result, advantages = learner_for(mine).step(samples)
    expected_advantages = todays_update(theirs, samples)
    assert advantages.tolist() == expected_advantages
    assert same_weights(mine, theirs)
    assert not same_weights(mine, policy())  # the step did move the weights
    assert (result.num_optimizer_steps, result.num_skipped_steps, result.kl_old) == (1, 0, [])


def test_mini_batches_are_optimizer_steps_on_consecutive_shares(policy):
    """Two mini-batches of whole groups = two ordinary steps, one on each half: pi_old is the engine's
    either way, the schedule is constant, and AdamW carries its state from the first to the second."""
    samples = make_samples(16)
    split, sequential = policy(), policy()
    result, _ = learner_for(split, mini_batches=2).step(samples)
    learner = learner_for(sequential)
    learner.step(samples[:8])
    learner.step([TrainSample(s.prompt, s.response, s.logprobs, s.reward, s.group) for s in samples[8:]])
    assert same_weights(split, sequential) and result.num_optimizer_steps == 2


def test_several_passes_keep_pi_old_from_before_the_first(policy):
    samples = make_samples(8)
    # with the engine's log-probs as pi_old, two passes are two steps on the same batch
    twice, again = policy(), policy()
    result, _ = learner_for(twice, num_iterations=2).step(samples)
    learner = learner_for(again)
    learner.step(samples)
    learner.step(samples)
    assert same_weights(twice, again) and result.num_optimizer_steps == 2
    # with pi_old recomputed, it is the model before the first pass: the second pass sees ratios off 1,
    # which a second step (recomputing pi_old from the updated model) would not
    result, _ = learner_for(policy(), num_iterations=3, recompute_old_logprobs=True).step(samples)
    assert len(result.kl_old) == 3 and 0 < result.kl_old[0] < result.kl_old[1] < result.kl_old[2]
    assert result.means.ratio_max > 1.0
    single, _ = learner_for(policy(), recompute_old_logprobs=True).step(samples)
    assert single.means.ratio_max == pytest.approx(1.0, abs=1e-6)


def test_a_gradient_that_is_not_finite_is_never_applied(policy):
    samples = make_samples(8)
    model = policy()
    before = copy.deepcopy(model)
    learner = learner_for(model)
    hook = next(model.parameters()).register_hook(lambda grad: grad * float("inf"))
    result, _ = learner.step(samples)
    assert result.num_skipped_steps == 1 and result.num_optimizer_steps == 0
    assert same_weights(model, before) and not learner.optimizer.state  # AdamW untouched too
    hook.remove()
    result, _ = learner.step(samples)
    assert result.num_skipped_steps == 0 and not same_weights(model, before)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_truncated_responses_train_no_token_with_mask_truncated(policy):
    samples = make_samples(8)
    for s in samples[::3]:
        s.finish_reason = "length"
    cut = [i for i, s in enumerate(samples) if s.finish_reason == "length"]
    masked, advantages = learner_for(policy(), mask_truncated=True).step(samples)
    plain, plain_advantages = learner_for(policy()).step(samples)
    assert masked.dropped_samples == {"truncated": len(cut)} and plain.dropped_samples == {}
    assert masked.num_tokens == sum(len(s.response) for i, s in enumerate(samples) if i not in cut)
    assert plain.num_tokens == sum(len(s.response) for s in samples)
    # they still count in their group's advantages: the baseline is the group's
    assert np.array_equal(advantages, plain_advantages) and np.abs(advantages[cut]).min() > 0


def test_a_sample_with_an_impossible_engine_logprob_is_left_out_by_name(policy):
    samples = make_samples(8)
    samples[2].logprobs = samples[2].logprobs.copy()
    samples[2].logprobs[0] = np.finfo(np.float32).min  # an engine's "impossible" token
    model = policy()
    result, _ = learner_for(model).step(samples)
    assert result.dropped_samples == {"impossible_logprob": 1}
    assert np.isfinite(result.pg_loss) and np.isfinite(result.grad_norm) and result.num_optimizer_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_kl_as_a_reward_penalty_lowers_each_samples_reward_by_its_summed_kl(policy):
    samples = make_samples(8)
    coef = 0.5
    _, advantages = learner_for(policy(), kl_coef=coef, kl_in="reward", kl_estimator="k1",
                                scale_rewards="none").step(samples)
    # expected, in plain floats: reward - coef * sum_t (log pi_old - log pi_ref), pi_old the engine's
    # log-probs, pi_ref the starting policy in bf16 (batched there, one by one here: bf16 rounding differs
    # by ~1e-4 of the sums); then centered inside each group of 4
    ref_model = policy().to(torch.bfloat16).eval()
    penalized = []
    for s in samples:
        ids = torch.tensor([list(s.prompt) + list(s.response)])
        with torch.no_grad():
            logits = ref_model(input_ids=ids[:, :-1]).logits.float()[0] / TEMPERATURE
        ref = torch.log_softmax(logits, -1)[len(s.prompt) - 1:].gather(-1, ids[0, len(s.prompt):, None])[:, 0]
        # each token's log-ratio is clamped to +-20 nats (no exp() overflows): random tokens reach it here
        penalized.append(s.reward - coef * sum(min(max(float(o) - float(r), -20.0), 20.0)
                                               for o, r in zip(s.logprobs, ref)))
    for g in range(2):
        r = penalized[4 * g:4 * g + 4]
        assert advantages[4 * g:4 * g + 4].tolist() == pytest.approx([x - sum(r) / 4 for x in r], rel=1e-3, abs=1e-2)
    # sign: a sample whose behaviour policy is further above the reference loses advantage
    strayed = copy.deepcopy(samples)
    strayed[1].logprobs = np.minimum(strayed[1].logprobs + np.float32(0.5), np.float32(-0.01))
    _, after = learner_for(policy(), kl_coef=coef, kl_in="reward", kl_estimator="k1",
                           scale_rewards="none").step(strayed)
    assert after[1] < advantages[1] - 0.1
