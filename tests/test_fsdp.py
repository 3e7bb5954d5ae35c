"""FSDP2 on CPU: one training step sharded over 2 gloo processes equals the same step in 1 process."""

import os
import subprocess
import sys

import torch

from conftest import REPO, free_port


def run_step(out_path, num_procs: int) -> dict:
    if num_procs == 1:
        cmd = [sys.executable, "-m", "harness.fsdp_step", str(out_path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(num_procs),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "harness.fsdp_step",
               str(out_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path)


def test_two_process_fully_shard_step_matches_one_process(tmp_path, policy_dir):
    from transformers import AutoModelForCausalLM

    one = run_step(tmp_path / "one.pt", 1)
    two = run_step(tmp_path / "two.pt", 2)
    base = dict(AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).named_parameters())
    assert one["params"].keys() == two["params"].keys() == base.keys()
    assert abs(one["loss"] - two["loss"]) <= 1e-6 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-6
    step = max((one["params"][k] - base[k]).abs().max().item() for k in base)
    gap = max((one["params"][k] - two["params"][k]).abs().max().item() for k in base)
    assert step > 1e-4, "the step did not change the weights"
    assert gap <= 1e-6, f"sharded step differs from the single-process step by {gap}"
