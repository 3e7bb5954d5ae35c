"""Shared fixtures: the project's small policy and a real local engine process serving it."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

# CI's two cores run two pytest workers beside the pipelines' processes (one torch thread each). torch's
# default, a thread a core, oversubscribes them in the workers' own tests and its waiting threads spin:
# a policy sweep test of 9 s took 81 s beside one pipeline run, 11 s with one thread. Child processes
# the tests start inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from harness.servers import REPO_ROOT as REPO
from harness.servers import free_port, start_local_engine, stop_process

__all__ = ["FINAL_PARITY", "GPU_ONLY", "REPO", "TWO_GPUS", "free_port", "report", "start_engine", "stop_process"]

IS_GPU = torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None
# GPU tests: marked `gpu`, skipped where there is no CUDA device or no sglang (as in CI)
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not IS_GPU, reason="needs a CUDA GPU and sglang")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
# A CPU run's final check (max |log p| gap, fp32 engine against the fp32 trainer, one 37-token probe of
# the small policy) when the engine serves the trained weights: up to ~1.2e-5, summation-order noise
# on log-probs near -11. One learner step moves the same probe by 0.2-0.3, so an engine a version
# behind is 2000x over this bound.
FINAL_PARITY = 1e-4


def report(key: str, value) -> None:
    """Print a measured figure and keep it in $NANOMILES_GPU_REPORT (a JSON object) if set."""
    print(f"GPU-REPORT {key} = {value}")
    path = os.environ.get("NANOMILES_GPU_REPORT")
    if path:
        data = json.loads(open(path).read()) if os.path.exists(path) else {}
        data[key] = value
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


@pytest.fixture(scope="session")
def policy_dir() -> Path:
    """The project's small policy (HF directory), built once and cached if missing."""
    from harness.policy import ensure_policy

    return ensure_policy()


def start_engine(model_dir: Path, log_path: Path):
    """A local engine process on a free port: (Popen, base URL)."""
    return start_local_engine(model_dir, log_path)


@pytest.fixture(scope="module")
def engine_url(policy_dir, tmp_path_factory):
    """A real local engine process serving the small policy; stopped after the module."""
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    proc, url = start_local_engine(policy_dir, log_path)
    yield url
    stop_process(proc)


@pytest.fixture
def long_talker(tmp_path):
    """A random model with no EOS and its engine: samples run to max_new_tokens, slow enough to be cut
    by a weight update (tests/test_async.py, tests/test_rollouts.py)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=None)
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "model")
    proc, url = start_engine(tmp_path / "model", tmp_path / "engine.log")
    yield model, url
    stop_process(proc)
