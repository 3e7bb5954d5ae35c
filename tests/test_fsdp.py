"""The sharded learner (trainer.strategy = fsdp2) on CPU: 2 gloo ranks under the trainer's own launcher
against one plain process, on the same samples (`harness/fsdp_step.py`)."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

# an odd number of micro-batches (a rank makes a pass without one of its own), every pi_old and KL
# path, two passes of two optimizer steps each
EVERY_PATH = ["--trainer.micro_batch_tokens=40", "--trainer.mini_batches=2", "--trainer.lr=1e-3",
              "--trainer.recompute_old_logprobs=true", "--trainer.kl_coef=0.05", "--trainer.kl_in=reward",
              "--trainer.num_iterations=2"]
PLAIN = ["--trainer.micro_batch_tokens=60", "--trainer.mini_batches=2", "--trainer.lr=1e-3"]
# Adam divides by the square root of small second moments: gradients that differ in their last bits
# (sums over 2 ranks in another order) move the next step's weights by up to ~1e-5
LATER_STEP_TOLERANCE = 3e-5


def run_steps(out, *args: str, world: int = 1) -> list[dict]:
    cmd = [sys.executable, "-m", "harness.fsdp_step", str(out), "--world-size", str(world), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def weight_gap(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys()
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def same(a: float | None, b: float | None) -> bool:
    return a is None and b is None or a is not None and b is not None and a == pytest.approx(b, rel=1e-5, abs=1e-7)


def assert_same_step(a: dict, b: dict, tolerance: float) -> None:
    ra, rb = a["result"], b["result"]
    assert ra["num_micro_batches"] == rb["num_micro_batches"] and ra["num_tokens"] == rb["num_tokens"]
    assert ra["num_optimizer_steps"] == rb["num_optimizer_steps"]
    for key in ("pg_loss", "grad_norm", "lr", "is_weight_mean"):
        assert same(ra[key], rb[key]), key
    for key, value in ra["means"].items():
        assert same(value, rb["means"][key]), key
    assert ra["kl_old"] == pytest.approx(rb["kl_old"], rel=1e-5)
    assert (a["advantages"] == b["advantages"]).all()
    gap = weight_gap(a, b)
    assert gap <= tolerance, f"the sharded step differs from the one-process step by {gap}"


def test_a_sharded_step_is_the_one_process_step(tmp_path):
    one = run_steps(tmp_path / "one.pt", "--steps", "2", *EVERY_PATH)
    two = run_steps(tmp_path / "two.pt", "--steps", "2", *EVERY_PATH, world=2)
    assert one[0]["result"]["num_micro_batches"] % 2 == 1  # so a rank makes a pass without its own
    assert one[0]["result"]["kl_old"] and one[0]["result"]["is_weight_mean"] is not None
    assert weight_gap(one[0], one[1]) > 1e-4, "the steps did not move the weights"
    assert_same_step(one[0], two[0], 1e-6)
    assert_same_step(one[1], two[1], LATER_STEP_TOLERANCE)


def test_checkpoints_resume_across_world_sizes(tmp_path):
    """2 ranks -> 1 process and 1 process -> 2 ranks: the next step is the one the uninterrupted run takes."""
    plain, shards = tmp_path / "plain", tmp_path / "shards"
    straight = run_steps(tmp_path / "straight.pt", "--steps", "2", "--save", str(plain), *PLAIN)
    two = run_steps(tmp_path / "two.pt", "--save", str(shards), *PLAIN, world=2)
    assert (shards / "optimizer").is_dir() and not (plain / "optimizer").exists()
    assert_same_step(straight[0], two[0], 1e-6)
    from_shards = run_steps(tmp_path / "from_shards.pt", "--load", str(shards), *PLAIN)
    from_plain = run_steps(tmp_path / "from_plain.pt", "--load", str(plain), *PLAIN, world=2)
    assert_same_step(straight[1], from_shards[0], LATER_STEP_TOLERANCE)
    assert_same_step(straight[1], from_plain[0], LATER_STEP_TOLERANCE)


def test_a_sharded_lora_step_and_its_checkpoints(tmp_path):
    """LoRA on a bf16 base, its KL reference the base with the adapters off: the merged weights a push
    sends, from 2 ranks and from one process, and checkpoints of adapters across world sizes."""
    lora = ["--trainer.lora_rank=8", "--trainer.dtype=bfloat16", "--trainer.kl_coef=0.05", "--trainer.lr=1e-2",
            "--trainer.micro_batch_tokens=40", "--trainer.mini_batches=2"]
    plain, shards = tmp_path / "plain", tmp_path / "shards"
    straight = run_steps(tmp_path / "straight.pt", "--steps", "2", "--save", str(plain), *lora)
    two = run_steps(tmp_path / "two.pt", "--save", str(shards), *lora, world=2)
    assert (shards / "adapter_model.safetensors").is_file() and not (shards / "model.safetensors").exists()
    assert weight_gap(straight[0], straight[1]) > 1e-4, "the adapters did not move the merged weights"
    assert_same_step(straight[0], two[0], 1e-6)
    from_shards = run_steps(tmp_path / "from_shards.pt", "--load", str(shards), *lora)
    from_plain = run_steps(tmp_path / "from_plain.pt", "--load", str(plain), *lora, world=2)
    assert_same_step(straight[1], from_shards[0], LATER_STEP_TOLERANCE)
    assert_same_step(straight[1], from_plain[0], LATER_STEP_TOLERANCE)
