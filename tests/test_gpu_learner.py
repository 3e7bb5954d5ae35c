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
from nano_miles.run.config import TrainerConfig
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
