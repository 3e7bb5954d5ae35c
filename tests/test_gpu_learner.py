"""The trainer's optimizer step on a CUDA device: micro-batches give the whole batch's step there too,
bf16 autocast keeps fp32 master weights and stays near the fp32 step, activation checkpointing changes
memory and not the step, and chunked log-probs keep a 152k-vocabulary step small.

Run on a GPU host: python -m pytest -m gpu tests/test_gpu_learner.py -s (needs no SGLang; skipped in CI).
"""

import numpy as np
import pytest
import torch

from conftest import GPU_ONLY, report
from harness.model_shapes import QWEN25_05B
from nano_miles.run.sections import TrainerConfig
from nano_miles.stages.trainer.learner import Learner, TrainSample

pytestmark = GPU_ONLY


def small_qwen(num_layers: int = 4):
    """The Qwen2.5-0.5B shape, fewer layers: its 152k vocabulary is what chunking is for."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen2ForCausalLM(Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": num_layers})).float()


def samples(num: int, response: int = 512) -> list[TrainSample]:
    rng = np.random.default_rng(0)
    return [TrainSample(rng.integers(3, 150000, int(rng.integers(20, 60))), rng.integers(3, 150000, response),
                        np.full(response, -11.0, np.float32), float(rng.choice([-1.0, 1.0])), i // 4)
            for i in range(num)]


def step(batch, **overrides) -> tuple:
    """One step on a fresh model, alone on the GPU (so its peak is its own): (result, grads on the CPU)."""
    model = small_qwen()
    result, _ = Learner(TrainerConfig(device="cuda", **overrides), model, pad_id=0, temperature=1.0).step(batch)
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    del model
    torch.cuda.empty_cache()
    return result, grads


def test_micro_batches_bf16_and_checkpointing_on_cuda():
    batch = samples(16)
    budget = 4 * 580  # about 4 samples a micro-batch
    runs = {"whole": step(batch), "micro": step(batch, micro_batch_tokens=budget),
            "ckpt": step(batch, micro_batch_tokens=budget, gradient_checkpointing=True),
            "bf16": step(batch, micro_batch_tokens=budget, gradient_checkpointing=True, dtype="bfloat16")}
    (whole, whole_grads), results = runs["whole"], {name: r for name, (r, _) in runs.items()}
    assert results["micro"].num_micro_batches >= 4
    scale = max(float(g.abs().max()) for g in whole_grads.values())
    for name in ("micro", "ckpt"):
        assert results[name].pg_loss == pytest.approx(whole.pg_loss, abs=1e-5)
        for n, g in runs[name][1].items():
            assert (g - whole_grads[n]).abs().max() <= 1e-4 * scale, (name, n)
    assert results["bf16"].pg_loss == pytest.approx(whole.pg_loss, rel=0.05, abs=1e-3)
    assert results["bf16"].means.entropy == pytest.approx(whole.means.entropy, rel=0.05)
    peaks = {name: r.peak_memory_mb for name, r in results.items()}
    assert peaks["ckpt"] < peaks["micro"] < peaks["whole"], peaks
    report("learner_peak_mb_16x580_4layer_qwen_shape", peaks)


def test_packed_flash_attention_gives_the_padded_scores_faster():
    """The trainer packs on a GPU (PyTorch's variable-length FlashAttention): same log-probs as the padded,
    masked batch within bf16 rounding, and the time of a forward and backward pass of each."""
    import copy
    import time

    from nano_miles.algo.grpo import assemble_batch, token_scores
    from nano_miles.stages.trainer import packed_attention
    model = small_qwen(num_layers=24)  # the whole 0.5B shape
    twin = copy.deepcopy(model)
    assert packed_attention.enable(twin)
    rng = np.random.default_rng(1)
    batch = [TrainSample(rng.integers(3, 150000, int(rng.integers(60, 200))),
                         rng.integers(3, 150000, int(rng.integers(64, 512))), np.full(512, -11.0, np.float32), 1.0, 0)
             for _ in range(24)]
    for s in batch:
        s.logprobs = s.logprobs[:len(s.response)]
    b = assemble_batch([s.prompt for s in batch], [s.response for s in batch], [s.logprobs for s in batch],
                       [0.0] * len(batch), pad_id=0).to("cuda")

    def forward_backward(m, pack):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp = token_scores(m, b.input_ids, b.targets, b.attention_mask, 1.0, positions=b.loss_mask,
                                packing=pack)[0]
        logp.sum().backward()
        return logp.detach()

    scores, seconds = {}, {}
    for name, m, pack in (("padded", model, None), ("packed", twin, b.packing)):
        forward_backward(m, pack)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            scores[name] = forward_backward(m, pack)
        torch.cuda.synchronize()
        seconds[name] = (time.perf_counter() - start) / 3
    gap = float((scores["packed"] - scores["padded"]).abs()[b.loss_mask].mean())
    assert gap < 0.01, gap
    report("packed_vs_padded_0.5b_shape_24_samples", {"mean_abs_logprob_gap": gap, "seconds": seconds,
                                                      "padding_fraction": 1 - b.packing.num_tokens / b.input_ids.numel()})


def test_compiled_layers_take_the_eager_step_faster():
    """trainer.compile at the whole 0.5B shape: the bf16 packed step of compiled decoder layers and
    log-prob chunks equals the eager one within bf16 rounding, and its time after compiling against the
    eager step's."""
    import time

    batch = samples(32)
    cfg = dict(device="cuda", dtype="bfloat16", micro_batch_tokens=16384)
    results, seconds, grads = {}, {}, {}
    for name, compiled in (("eager", False), ("compiled", True)):
        model = small_qwen(num_layers=24)
        learner = Learner(TrainerConfig(compile=compiled, lr=0.0, **cfg), model, pad_id=0, temperature=1.0)
        learner.step(batch)  # compiles, warms the allocator and the optimizer's state
        torch.cuda.synchronize()
        start = time.perf_counter()
        results[name], _ = learner.step(batch)
        torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - start
        grads[name] = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        del model, learner
        torch.cuda.empty_cache()
    assert results["compiled"].pg_loss == pytest.approx(results["eager"].pg_loss, rel=0.02, abs=1e-3)
    assert results["compiled"].means.entropy == pytest.approx(results["eager"].means.entropy, rel=0.02)
    cosine = torch.nn.functional.cosine_similarity(grads["compiled"], grads["eager"], dim=0)
    assert cosine > 0.99, cosine
    report("compiled_vs_eager_step_s_0.5b_shape_32x580", {**seconds, "grad_cosine": float(cosine)})
