"""The trainer's optimizer step at any size: micro-batches give the whole batch's update, chunked
log-probs are the full forward's, the schedule resumes, entropy and KL are what they claim.

Run: `pytest tests/test_learner.py` (the shipped small policy on CPU, fp32; bf16 autocast on CPU too).
"""

import copy
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from nano_miles.algo import grpo
from nano_miles.algo.grpo import assemble_batch, micro_batches, token_scores
from nano_miles.run.sections import TrainerConfig
from nano_miles.stages.trainer.learner import Learner, TrainSample, lr_factor

TEMPERATURE = 0.8


@pytest.fixture
def policy(policy_dir):
    return lambda: AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)


def make_samples(num: int, seed: int = 0, group_size: int = 3) -> list[TrainSample]:
    """Samples of very different lengths, behaviour log-probs near a real policy's, rewards in [0, 1] that
    differ inside each group of `group_size` (so advantages are + and -)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num):
        prompt = rng.integers(3, 260, size=int(rng.integers(4, 20)))
        response = rng.integers(3, 260, size=int(rng.integers(2, 40)))
        logprobs = -rng.uniform(0.1, 4.0, size=len(response)).astype(np.float32)
        reward = float(np.float32(rng.uniform(0, 1)))  # as the wire carries it
        samples.append(TrainSample(prompt, response, logprobs, reward, i // group_size))
    return samples


def step_with(model, samples, **overrides):
    """One step of a Learner with the trainer's defaults (AdamW, lr 1e-4) and `overrides`: (learner,
    what the step did)."""
    learner = Learner(TrainerConfig(**overrides), model, pad_id=0, temperature=TEMPERATURE, max_new_tokens=40)
    return learner, learner.step(samples)[0]


def test_micro_batches_respect_the_budget_and_take_every_sample_once():
    lengths = [5, 40, 12, 40, 7, 90, 3, 12]
    for budget in (1, 50, 100, 200, 10_000):
        batches = micro_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget, (budget, b)
        widths = [lengths[b[0]] for b in batches]
        assert widths == sorted(widths, reverse=True)  # longest first: similar lengths share a batch
    assert micro_batches(lengths, 0) == [list(range(len(lengths)))]
    assert len(micro_batches(lengths, 1)) == len(lengths)  # over budget: each sample alone


def test_micro_batched_step_is_the_whole_batch_step(policy):
    """Token mean over the whole step: the same gradient, and the same parameters after one AdamW step,
    whether the batch is split 1, 2 or many ways.

    The gradients agree to 5e-6 of the largest one: float sums in another order and other padding, well
    below the fp32 step's own error (1.7e-5 of scale against the same step in float64). AdamW's
    first update is lr * g / (|g| + eps), which moves a weight by at most lr * |g - g'| / eps more
    in one run than in the other: where |g| is near eps (1e-8) that turns rounding into parameter
    differences of up to ~1e-5 at lr 1e-4, so those elements are held to the difference their own
    gradients explain, the rest to 1e-6; a real error (a micro-batch weighed wrongly) moves
    thousands of elements with ordinary gradients by ~lr."""
    samples = make_samples(12)
    longest = max(len(s.prompt) + len(s.response) - 1 for s in samples)
    whole_model = policy()
    _, whole = step_with(whole_model, samples)
    splits = {}
    for budget in (100 * longest, 6 * longest, longest):
        model = policy()
        learner, result = step_with(model, samples, micro_batch_tokens=budget)
        lr, eps = result.lr, learner.optimizer.param_groups[0]["eps"]  # the step's lr, before the schedule moves it
        splits[budget] = result.num_micro_batches
        assert result.pg_loss == pytest.approx(whole.pg_loss, abs=1e-6)
        assert result.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
        assert result.num_tokens == whole.num_tokens and result.means.entropy == pytest.approx(whole.means.entropy, rel=1e-5)
        scale = max(float(q.grad.abs().max()) for q in whole_model.parameters())
        for (name, p), q in zip(model.named_parameters(), whole_model.parameters()):
            assert (p.grad - q.grad).abs().max() <= 5e-6 * scale, (budget, name)
            gap = (p - q).abs()
            explained = lr * (p.grad - q.grad).abs() / eps + 1e-6
            assert (gap[q.grad.abs() >= 1e-7] <= 1e-6).all() and (gap <= explained).all(), (budget, name)
    assert splits[100 * longest] == 1 and splits[6 * longest] == 2 and splits[longest] >= 6, splits


def test_chunked_log_probs_and_their_gradients_are_the_full_forwards(policy, monkeypatch):
    """Scoring a few tokens at a time (recomputed in backward) = one full-vocabulary forward, in fp32."""
    samples = make_samples(5, seed=1)
    batch = assemble_batch([s.prompt for s in samples], [s.response for s in samples],
                           [s.logprobs for s in samples], [s.reward - 0.5 for s in samples], pad_id=0)
    full_model, chunked_model = policy(), policy()
    logits = full_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / TEMPERATURE
    logp_all = torch.log_softmax(logits, -1)
    want_logp = logp_all.gather(-1, batch.targets[..., None])[..., 0] * batch.loss_mask
    want_entropy = -(logp_all.exp() * logp_all).sum(-1) * batch.loss_mask
    (want_logp * batch.advantages).sum().backward()

    vocab = chunked_model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(grpo, "LOGIT_CHUNK_ELEMENTS", 7 * vocab)  # 7 tokens per chunk: many chunks
    logp, entropy = token_scores(chunked_model, batch.input_ids, batch.targets, batch.attention_mask,
                                 TEMPERATURE, positions=batch.loss_mask, with_entropy=True)
    assert batch.num_tokens > 10 * 7
    (logp * batch.advantages).sum().backward()
    assert logp.dtype == torch.float32
    assert (logp - want_logp).abs().max() <= 1e-5 and (entropy - want_entropy.detach()).abs().max() <= 1e-5
    assert (logp[~batch.loss_mask] == 0).all()
    for (name, p), q in zip(chunked_model.named_parameters(), full_model.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * max(1.0, float(q.grad.abs().max())), name


def test_gradient_checkpointing_changes_memory_not_the_step(policy):
    samples = make_samples(6, seed=2)
    plain, checkpointed = policy(), policy()
    step_with(plain, samples)
    step_with(checkpointed, samples, gradient_checkpointing=True)
    for (name, p), q in zip(checkpointed.named_parameters(), plain.parameters()):
        assert (p - q).abs().max() <= 1e-6, name


def test_bfloat16_autocast_keeps_fp32_weights_and_nearly_the_fp32_step(policy):
    samples = make_samples(6, seed=3)
    fp32_model, bf16_model = policy(), policy()
    _, fp32 = step_with(fp32_model, samples)
    learner, bf16 = step_with(bf16_model, samples, dtype="bfloat16")
    assert all(p.dtype == torch.float32 for p in bf16_model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in learner.optimizer.state.values())
    assert bf16.pg_loss == pytest.approx(fp32.pg_loss, rel=0.05, abs=1e-3)
    assert bf16.means.entropy == pytest.approx(fp32.means.entropy, rel=0.05)
    moved = [(p - q).abs().max() for p, q in zip(bf16_model.parameters(), fp32_model.parameters())]
    assert max(moved) > 0  # bf16 is not the fp32 computation, only close to it


def test_entropy_and_k3_kl_are_what_a_plain_forward_gives(policy):
    samples = make_samples(6, seed=4)
    model = policy()
    base = copy.deepcopy(model)
    learner, first = step_with(model, samples, kl_coef=0.1)
    batch = learner.assemble(samples, [0.0] * len(samples))
    with torch.no_grad():  # the step scored the model before its update, i.e. the base policy
        logp_all = torch.log_softmax(base(input_ids=batch.input_ids).logits / TEMPERATURE, -1)
        ref_all = torch.log_softmax(base.to(torch.bfloat16)(input_ids=batch.input_ids).logits.float() / TEMPERATURE, -1)
    mask = batch.loss_mask
    entropy = -(logp_all.exp() * logp_all).sum(-1)[mask].mean()
    logp, ref = (x.gather(-1, batch.targets[..., None])[..., 0][mask] for x in (logp_all, ref_all))
    k3 = (torch.exp(ref - logp) - (ref - logp) - 1).mean()
    assert first.means.entropy == pytest.approx(float(entropy), rel=1e-5)
    assert first.means.kl == pytest.approx(float(k3), rel=1e-3) and first.means.kl >= 0
    for _ in range(3):
        later, _ = learner.step(samples)
    assert later.means.kl > 10 * first.means.kl  # the policy moved away from its bf16 starting copy
    _, off = step_with(policy(), samples)
    assert off.means.kl is None


def test_learning_rate_warms_up_then_follows_the_cosine_to_lr_min():
    factors = [lr_factor(s, 3, "cosine", 10, 0.1) for s in range(10)]
    assert factors[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert factors[-1] == pytest.approx(0.1) and all(a > b for a, b in zip(factors[3:], factors[4:]))
    assert factors[3] == 1.0  # the cosine starts at the peak the warm-up reached
    assert factors[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 6)))  # 2 of 6 decay steps
    assert [lr_factor(s, 2, "constant", 10, 0.0) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
