"""SGLang in the engine slot on a GPU: token-in/token-out, bf16 parity with the trainer, CUDA-IPC
weight updates (SGLang's bucket path and the flat path), pause modes. The sync run under supervisord
is in test_gpu_pipeline.py: its own module, so this module's SGLang server is gone before it starts
(two servers at --mem-fraction-static 0.3 do not both pass SGLang's free-memory check).

Run on a GPU host with sglang installed: python -m pytest -m gpu tests/test_gpu.py -s
Everything here is skipped where there is no CUDA device or no sglang (CI). With
$NANOMILES_GPU_REPORT set, the measured figures are also written there as JSON.
"""

import copy
import threading
import time

import pytest
import torch

from conftest import GPU_ONLY, report
from nano_miles.algo.grpo import assemble_batch, token_logprobs
from nano_miles.engine.client import EngineClient, parse_output

pytestmark = GPU_ONLY

IM_END = 262  # the small policy's end-of-turn token
MAX_PARITY_BF16 = 0.01  # mean |log p_engine - log p_trainer| over response tokens, both in bf16


@pytest.fixture(scope="module")
def sglang_url(policy_dir, tmp_path_factory):
    from harness.servers import start_sglang, stop_sglang

    proc, url = start_sglang(policy_dir, tmp_path_factory.mktemp("sglang") / "engine.log")
    yield url
    stop_sglang(proc)


@pytest.fixture(scope="module")
def prompts(policy_dir):
    from transformers import AutoTokenizer

    from nano_miles.tasks.arithmetic import make_problems
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    return [tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
            for p in make_problems("test", 32, 0)]


def load_trainer_model(policy_dir, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=dtype).to("cuda").eval()


def sample(client, prompts, max_new_tokens=32):
    """(tokens, logprobs) per prompt, without a final <|im_end|>: SGLang 0.5.16 echoes that id as 0 when
    it ends the input of a prefill-only score (docs/sglang-contract.md §2.4), so it cannot be scored."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    outs = client.generate(prompts, params, return_logprob=True)
    samples = [parse_output(o["meta_info"], o["output_ids"])[:2] for o in outs]
    return [(t[:-1], lp[:-1]) if t[-1:] == [IM_END] else (t, lp) for t, lp in samples]


def trainer_logprobs(model, prompts, responses) -> list[list[float]]:
    """The trainer's T=1 logprobs of each response token (grpo.token_logprobs, as in training)."""
    zeros = [[0.0] * len(r) for r in responses]
    batch = assemble_batch(prompts, responses, zeros, [0.0] * len(prompts), pad_id=0).to("cuda")
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids, batch.targets, batch.attention_mask, 1.0)
    return [logp[i][batch.loss_mask[i]].tolist() for i in range(len(prompts))]


def mean_abs_gap(a: list[list[float]], b: list[list[float]]) -> float:
    gaps = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb, strict=True)]
    return sum(gaps) / len(gaps)


def engine_scores(client, prompts, responses) -> list[list[float]]:
    """Prefill scores from an empty radix cache: a cached prompt prefix takes another kernel path
    (extend instead of full prefill), which moves bf16 logprobs by up to ~0.1, so scores compared
    across weight updates must start from the same cache state."""
    client.flush_cache()
    return [client.score(p, r) for p, r in zip(prompts, responses)]


def decode_gap(client, prompts, model_bf16) -> float:
    """Mean |log p| gap between freshly sampled rollout logprobs and the trainer's: the engine decodes
    in its captured CUDA graphs, so this checks that the graphs run the weights last pushed."""
    samples = sample(client, prompts, 16)
    return mean_abs_gap([s[1] for s in samples], trainer_logprobs(model_bf16, prompts, [s[0] for s in samples]))


def greedy(client, prompts) -> list[list[int]]:
    outs = client.generate(prompts, {"max_new_tokens": 16, "temperature": 0.0}, return_logprob=False)
    return [o["output_ids"] for o in outs]


def test_tito_single_sample(sglang_url, prompts):
    client = EngineClient(sglang_url)
    out = client.generate(prompts[0], {"max_new_tokens": 24, "temperature": 1.0, "top_k": -1},
                          return_logprob=True)
    assert isinstance(out, dict) and "text" not in out  # ids in, ids out: no tokenizer in the engine
    tokens, logprobs, finish, version = parse_output(out["meta_info"], out["output_ids"])
    assert 1 <= len(tokens) <= 24 and len(logprobs) == len(tokens)
    assert all(lp <= 0.0 for lp in logprobs)
    assert finish in ("stop", "length") and version == client.model_info()["weight_version"]
    if finish == "stop":
        assert tokens[-1] == 1  # the matched EOS is part of the output


def test_prefill_parity_bf16(sglang_url, prompts, policy_dir):
    client = EngineClient(sglang_url)
    samples = sample(client, prompts)
    responses = [s[0] for s in samples]
    engine_prefill = engine_scores(client, prompts, responses)
    model = load_trainer_model(policy_dir, torch.bfloat16)
    trainer = trainer_logprobs(model, prompts, responses)
    prefill_gap = mean_abs_gap(engine_prefill, trainer)
    rollout_gap = mean_abs_gap([s[1] for s in samples], trainer)
    fp32_gap = mean_abs_gap(engine_prefill, trainer_logprobs(load_trainer_model(policy_dir, torch.float32),
                                                             prompts, responses))
    report("parity_prefill_bf16_mean_abs", prefill_gap)
    report("parity_rollout_bf16_mean_abs", rollout_gap)
    report("parity_prefill_engine_bf16_vs_trainer_fp32_mean_abs", fp32_gap)
    report("parity_num_tokens", sum(len(r) for r in responses))
    assert prefill_gap <= MAX_PARITY_BF16
    assert rollout_gap <= 2 * MAX_PARITY_BF16


def test_weight_update_changes_outputs_and_parity_holds(sglang_url, prompts, policy_dir):
    from nano_miles.weights.flat_sender import FlatSender
    from nano_miles.weights.tensor_sender import push_weights

    client = EngineClient(sglang_url)
    probe = prompts[:16]
    reference_greedy = greedy(client, probe)
    responses = [s[0] for s in sample(client, probe, 16)]
    reference_scores = engine_scores(client, probe, responses)

    model = load_trainer_model(policy_dir, torch.float32)  # the trainer keeps fp32 weights
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * p.std() * torch.randn_like(p))  # far larger than an optimizer step
    client.pause("abort")
    split = push_weights(client, model, 1)  # SGLang's own FlattenedTensorBucket path
    client.resume()
    report("policy_bucket_update_ms", 1000 * split["total_s"])
    assert client.model_info()["weight_version"] == "1"
    assert greedy(client, probe) != reference_greedy, "new weights must change the engine's outputs"
    after_bucket = engine_scores(client, probe, responses)
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    gap = mean_abs_gap(after_bucket, trainer_logprobs(model_bf16, probe, responses))
    report("parity_prefill_bf16_after_update_mean_abs", gap)
    assert gap <= MAX_PARITY_BF16
    gap = decode_gap(client, probe, model_bf16)
    report("parity_decode_bf16_after_update_mean_abs", gap)
    assert gap <= 2 * MAX_PARITY_BF16

    pusher = FlatSender(client)  # the same weights through the flat path: same engine state
    client.pause("abort")
    pusher.push(model, 2)
    client.resume()
    assert client.model_info()["weight_version"] == "2"
    after_flat = engine_scores(client, probe, responses)
    assert mean_abs_gap(after_flat, after_bucket) < 1e-3  # a misplaced tensor moves it by >> 0.01
    gap = decode_gap(client, probe, model_bf16)
    report("parity_decode_bf16_after_flat_update_mean_abs", gap)
    assert gap <= 2 * MAX_PARITY_BF16

    with torch.no_grad():  # back to the original weights through the flat path (mapping reused)
        for n, p in model.named_parameters():
            p.copy_(original[n])
    client.pause("abort")
    pusher.push(model, 3)
    client.resume()
    assert greedy(client, probe) == reference_greedy
    restored = engine_scores(client, probe, responses)
    assert mean_abs_gap(restored, reference_scores) < 1e-3


def test_a_lora_model_reaches_the_engine_merged(sglang_url, prompts, policy_dir):
    """trainer.lora_rank > 0: the flat path sends the base with the adapters merged in; the engine then
    scores as the trainer's LoRA model does, and pushing the plain base restores the engine exactly."""
    from nano_miles.run.sections import TrainerConfig
    from nano_miles.stages.trainer import lora
    from nano_miles.weights.flat_sender import FlatSender

    client = EngineClient(sglang_url)
    probe = prompts[:16]
    responses = [s[0] for s in sample(client, probe, 16)]
    before = engine_scores(client, probe, responses)
    model = lora.wrap(load_trainer_model(policy_dir, torch.float32), TrainerConfig(lora_rank=8)).to("cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.05)  # adapters far from zero: the merged model differs visibly
    pusher = FlatSender(client)
    client.pause("abort")
    pusher.push(model, 1)
    client.resume()
    merged = copy.deepcopy(model).merge_and_unload().to(torch.bfloat16)
    after = engine_scores(client, probe, responses)
    assert mean_abs_gap(after, before) > 0.05, "the adapters must reach the engine"
    gap = mean_abs_gap(after, trainer_logprobs(merged, probe, responses))
    report("parity_prefill_bf16_after_lora_flat_update_mean_abs", gap)
    assert gap <= MAX_PARITY_BF16
    client.pause("abort")
    pusher.push(load_trainer_model(policy_dir, torch.float32), 2)  # the plain base again, same layout
    client.resume()
    assert mean_abs_gap(engine_scores(client, probe, responses), before) < 1e-3


def test_prefix_cache_is_reported(sglang_url):
    """Started for abort-mode pauses, SGLang keeps its radix cache: the trainer's updates must flush it."""
    from nano_miles.engine.client import has_prefix_cache
    assert has_prefix_cache(EngineClient(sglang_url))


def test_pause_modes(sglang_url, prompts):
    client = EngineClient(sglang_url)
    long = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    results = {}
    worker = threading.Thread(target=lambda: results.update(
        out=EngineClient(sglang_url).generate(prompts[:16], long, return_logprob=True)))
    worker.start()
    time.sleep(0.2)
    client.pause("abort")  # returns once every running request has returned
    worker.join(timeout=30)
    client.resume()
    finishes = [o["meta_info"]["finish_reason"]["type"] for o in results["out"]]
    assert "abort" in finishes, finishes
    for o in results["out"]:  # an aborted request keeps its tokens and their logprobs
        tokens, logprobs, _, _ = parse_output(o["meta_info"], o["output_ids"])
        assert len(tokens) == len(logprobs) <= 200
    for mode in ("in_place", "retract"):
        client.pause(mode)
        client.resume()
        assert len(greedy(client, prompts[:2])) == 2


def test_update_during_in_place_pause_keeps_requests(sglang_url, prompts, policy_dir):
    """What async mode does with pause_mode in_place: requests stay in the engine across a weight
    update (no flush: they hold KV) and finish normally on the new weights."""
    from nano_miles.weights.tensor_sender import push_weights

    client = EngineClient(sglang_url)
    version = int(client.model_info()["weight_version"]) + 1
    long = {"max_new_tokens": 190, "temperature": 1.0, "ignore_eos": True}  # prompt + 190 < 256 positions
    model = load_trainer_model(policy_dir, torch.float32)
    results = {}
    worker = threading.Thread(target=lambda: results.update(
        out=EngineClient(sglang_url).generate(prompts[:8], long, return_logprob=True)))
    worker.start()
    time.sleep(0.15)
    client.pause("in_place")
    push_weights(client, model, version, flush_cache=False)
    client.resume()
    worker.join(timeout=60)
    assert not worker.is_alive()
    for o in results["out"]:
        tokens, logprobs, finish, served = parse_output(o["meta_info"], o["output_ids"])
        assert finish == "length" and len(tokens) == len(logprobs) == 190
        assert str(served) == str(version)  # finished after the update (0.5.16 reads it at the end)
    assert client.model_info()["weight_version"] == str(version)
