"""One sample from prompt to gradient: real engine process, real policy, GRPO math, weight sync."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nano_miles.algo.advantages import estimate
from nano_miles.algo.grpo import assemble_batch, token_logprobs
from nano_miles.algo.loss import LossConfig, policy_loss
from nano_miles.engine.client import EngineClient, parse_output
from nano_miles.run.sections import TaskConfig
from nano_miles.tasks.prompts import encode_prompts, make_decoder
from nano_miles.tasks.arithmetic import make_problems, reward
from nano_miles.weights.tensor_sender import push_weights

G = 8
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def policy(policy_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(policy_dir))


def rollout_batch(engine: EngineClient, tokenizer, num_prompts: int, seed: int = 0):
    """Generate G samples for each of a few train prompts, score them, whiten per group."""
    problems = make_problems("train", num_prompts, seed=seed)
    prompts = encode_prompts(tokenizer, problems, TaskConfig())
    decode = make_decoder(tokenizer)
    rows, rewards = [], []
    for problem, prompt in zip(problems, prompts):
        outs = engine.generate([prompt] * G, {"max_new_tokens": 40, "temperature": TEMPERATURE})
        group = []
        for out in outs:
            tokens, logprobs, _, version = parse_output(out["meta_info"], out["output_ids"])
            group.append(reward(decode(tokens), problem.answer)["reward"])
            rows.append((prompt, tokens, logprobs, version))
        rewards.append(group)
    adv = torch.cat(estimate("grpo", rewards)).tolist()
    batch = assemble_batch([np.array(r[0]) for r in rows], [np.array(r[1]) for r in rows],
                           [np.array(r[2], np.float32) for r in rows], adv, tokenizer.pad_token_id)
    return batch, torch.tensor(rewards), {r[3] for r in rows}


def trainer_logprobs(model, batch):
    with torch.no_grad():
        return token_logprobs(model, batch.input_ids, batch.targets, batch.attention_mask, TEMPERATURE)


def test_group_rollout_to_loss_end_to_end_with_step0_parity(engine_url, policy):
    model, tokenizer = policy
    engine = EngineClient(engine_url)
    push_weights(engine, model, 0)
    batch, rewards, versions = rollout_batch(engine, tokenizer, num_prompts=4)
    assert versions == {"0"}
    assert batch.num_tokens == int(batch.loss_mask.sum()) > 0
    logp = trainer_logprobs(model, batch)
    out = policy_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, LossConfig())
    # engine (KV-cached, batched decode) and trainer (one full forward) agree in fp32
    assert out.means.parity <= 1e-5
    assert out.means.clip_fraction == 0.0 and out.means.dual_clip_fraction == 0.0
    # with the trainer's own logprobs as the old policy the ratio is exactly 1
    exact = policy_loss(logp, logp, batch.advantages, batch.loss_mask)
    masked_adv = batch.advantages[batch.loss_mask]
    assert exact.loss.item() == pytest.approx(-masked_adv.mean().item(), abs=1e-7)
    # advantages: zero-mean per group unless the group carried no signal at all
    adv = batch.advantages.sum(dim=1) / batch.loss_mask.sum(dim=1)
    assert torch.allclose(adv.view(4, G).sum(dim=1), torch.zeros(4), atol=1e-4)


def test_trainer_logprobs_match_the_engine_sampling_with_temperature_top_k_and_top_p(engine_url, policy):
    """The engine reports log_softmax(logits / T) before top-k/top-p truncation (SGLang's semantics), so
    the trainer's logprobs at the same T reproduce them although sampling was truncated."""
    model, tokenizer = policy
    engine = EngineClient(engine_url)
    push_weights(engine, model, 0)
    temperature, top_k, top_p = 0.7, 4, 0.9  # a small k: top 20 holds > 99.9 % of this peaked policy
    prompts = encode_prompts(tokenizer, make_problems("train", 4, seed=2), TaskConfig())
    requests = [p for p in prompts for _ in range(4)]
    params = [{"max_new_tokens": 24, "temperature": temperature, "top_k": top_k, "top_p": top_p,
               "ignore_eos": True, "sampling_seed": 100 + i} for i in range(len(requests))]
    rows = [parse_output(out["meta_info"], out["output_ids"])[:2] for out in engine.generate(requests, params)]
    batch = assemble_batch([np.array(p) for p in requests], [np.array(tokens) for tokens, _ in rows],
                           [np.array(logprobs, np.float32) for _, logprobs in rows], [0.0] * len(rows),
                           tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = token_logprobs(model, batch.input_ids, batch.targets, batch.attention_mask, temperature)
    out = policy_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, LossConfig())
    assert out.means.parity <= 1e-5  # the bound of the temperature-1 case above
    gaps = (logp - batch.old_logprobs)[batch.loss_mask].abs()
    assert gaps.max() <= 1e-4
    # sampling was truncated all the same: every sampled token is among the top k, and inside the top-p
    # nucleus of the top-k distribution; and the truncation cut off a part of the mass at many positions
    probs = torch.softmax(logits[batch.loss_mask].double() / temperature, -1)
    chosen = probs.gather(1, batch.targets[batch.loss_mask][:, None])
    assert ((probs > chosen).sum(dim=1) < top_k).all()
    top = probs.sort(dim=1, descending=True).values[:, :top_k]
    mass_above = torch.where(top > chosen, top, torch.zeros_like(top)).sum(dim=1)
    assert (mass_above < top_p * top.sum(dim=1) + 1e-6).all()
    mass_before = top.cumsum(dim=1) - top
    kept = torch.where(mass_before < top_p * top.sum(dim=1, keepdim=True), top, torch.zeros_like(top)).sum(dim=1)
    assert (1 - kept > 1e-2).float().mean() > 0.05


def test_one_step_moves_logprobs_along_advantages_and_sync_restores_parity(engine_url, policy_dir):
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    engine = EngineClient(engine_url)
    push_weights(engine, model, 0)
    # Sampling is not seeded; about half the groups hold both right and wrong answers, so with 12
    # groups the chance that none does is ~0.5**12.
    batch, rewards, _ = rollout_batch(engine, tokenizer, num_prompts=12, seed=1)
    assert (rewards.std(dim=1) > 0).any(), "no group carried a learning signal"
    before = trainer_logprobs(model, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    logp = token_logprobs(model, batch.input_ids, batch.targets, batch.attention_mask, TEMPERATURE)
    policy_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask).loss.backward()
    optimizer.step()
    after = trainer_logprobs(model, batch)
    per_sample_adv = batch.advantages.sum(dim=1) / batch.loss_mask.sum(dim=1).clamp(min=1)
    delta = ((after - before) * batch.loss_mask).sum(dim=1)
    pos, neg = per_sample_adv > 0, per_sample_adv < 0
    assert delta[pos].mean() > 0 > delta[neg].mean()

    # the engine still serves the old weights: its scores differ from the trainer's new ones
    prompt_len = int((~batch.loss_mask[0]).long().argmin()) + 1
    prompt = batch.input_ids[0, :prompt_len].tolist()
    response = batch.targets[0][batch.loss_mask[0]].tolist()
    new = after[0][batch.loss_mask[0]]
    stale_gap = (torch.tensor(engine.score(prompt, response)) - new).abs().mean().item()
    assert stale_gap > 1e-4
    push_weights(engine, model, 1)
    assert engine.model_info()["weight_version"] == "1"
    # temperature 1: prefill scores are directly comparable to the trainer's logprobs
    gap = (torch.tensor(engine.score(prompt, response)) - new).abs().mean().item()
    assert gap <= 1e-5
    out = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0.0})
    assert out["meta_info"]["weight_version"] == "1"
