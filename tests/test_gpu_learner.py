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
from nano_miles.stages.trainer.learner import Learner, Sample

pytestmark = GPU_ONLY


def small_qwen(num_layers: int = 4):
    """The Qwen2.5-0.5B shape, fewer layers: its 152k vocabulary is what chunking is for."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen2ForCausalLM(Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": num_layers})).float()


def samples(num: int, response: int = 96) -> list[Sample]:
    rng = np.random.default_rng(0)
    return [Sample(rng.integers(3, 150000, int(rng.integers(20, 60))), rng.integers(3, 150000, response),
                   np.full(response, -11.0, np.float32), float(rng.choice([-1.0, 1.0]))) for _ in range(num)]


def step(model, batch, **overrides):
    learner = Learner(TrainerConfig(device="cuda", **overrides), model, pad_id=0, temperature=1.0)
    return learner.step(batch)


def test_micro_batches_bf16_and_checkpointing_on_cuda():
    batch = samples(16)
    models = {name: small_qwen() for name in ("whole", "micro", "ckpt", "bf16")}
    results = {"whole": step(models["whole"], batch),
               "micro": step(models["micro"], batch, micro_batch_tokens=600),
               "ckpt": step(models["ckpt"], batch, micro_batch_tokens=600, gradient_checkpointing=True),
               "bf16": step(models["bf16"], batch, micro_batch_tokens=600, gradient_checkpointing=True,
                            dtype="bfloat16")}
    assert results["micro"].num_micro_batches >= 4
    whole = models["whole"]
    scale = max(float(p.grad.abs().max()) for p in whole.parameters())
    for name in ("micro", "ckpt"):
        assert results[name].loss == pytest.approx(results["whole"].loss, abs=1e-5)
        for (n, p), q in zip(models[name].named_parameters(), whole.parameters()):
            assert (p.grad - q.grad).abs().max() <= 1e-4 * scale, (name, n)  # TF32-free fp32 on CUDA
    assert all(p.dtype == torch.float32 for p in models["bf16"].parameters())
    assert results["bf16"].loss == pytest.approx(results["whole"].loss, rel=0.05, abs=1e-3)
    assert results["bf16"].entropy == pytest.approx(results["whole"].entropy, rel=0.05)
    peaks = {name: r.peak_memory_mb for name, r in results.items()}
    assert peaks["ckpt"] < peaks["micro"] <= peaks["whole"], peaks
    report("learner_peak_mb_16x96_4layer_qwen_shape", peaks)
