"""The learner's steps on fixed samples, in one process or sharded over ranks (`trainer.strategy = "fsdp2"`).

Run: python -m harness.fsdp_step OUT.pt [--world-size N] [--steps K] [--load DIR] [--save DIR] [--trainer.KEY=VALUE ...]

Rank 0 writes OUT.pt: each step's `LearnResult` fields and advantages, and the full weights after it
as a push sends them (a LoRA model's merged).
With `--save DIR` the checkpoint's model files and learner state go to DIR after the first step (as
the trainer's checkpoint writes them); `--load DIR` starts from such a directory. The ranks run under
the trainer's own launcher and do the trainer's own work (`sharded.Work`), so `tests/test_fsdp.py`
compares the sharded learner with the one-process learner on the same samples.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, run

RANK = int(os.environ.get("RANK", "0"))


def samples_of_step(step: int, num_groups: int = 4, group_size: int = 3) -> list:
    """A fixed rollout batch for `step`: groups of responses of varied lengths, rewards and log-probs."""
    import torch

    from nano_miles.stages.trainer.learner import TrainSample
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for g in range(num_groups):
        prompt = torch.randint(3, 200, (4 + g,), generator=gen).tolist()
        for k in range(group_size):
            n = 3 + (g * group_size + k) % 7
            response = torch.randint(3, 200, (n,), generator=gen).tolist()
            logprobs = (-torch.rand(n, generator=gen) * 3 - 0.5).tolist()
            out.append(TrainSample(prompt, response, logprobs, float((g + k) % 2), g))
    return out


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m harness.fsdp_step", description=__doc__)
    parser.add_argument("out", type=Path, help="rank 0's results and weights (torch.save)")
    parser.add_argument("--world-size", type=int, default=1, help="ranks; > 1 shards the model (FSDP2)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--load", type=Path, help="a directory written by --save to start from")
    parser.add_argument("--save", type=Path, help="where to write the model and learner state after step 1")
    args, overrides = parser.parse_known_args(argv)
    from nano_miles.stages.trainer import ranks
    if args.world_size > 1 and "RANK" not in os.environ:
        return ranks.launch(__file__, argv, args.world_size)
    import dataclasses

    import torch

    from nano_miles.run.config import load_config
    from nano_miles.stages.trainer import lora
    from nano_miles.stages.trainer.checkpoint import STATE_FILE
    from nano_miles.stages.trainer.learner import Learner
    from nano_miles.stages.trainer.sharded import Work, gathered_named_tensors
    from nano_miles.weights.named_tensors import trainable_named_tensors

    strategy = ["--trainer.strategy=fsdp2", f"--trainer.world_size={args.world_size}"] if args.world_size > 1 else []
    cfg = load_config(None, [*strategy, *overrides])
    torch.set_num_threads(1)
    if args.world_size > 1:
        ranks.join("cpu")
    model = ranks.load_policy(cfg)  # the shipped policy; LoRA adapters seeded alike on every rank
    learner = Learner(cfg.trainer, model, pad_id=0, temperature=1.0, max_new_tokens=16)
    work = Work(model, learner, RANK)
    base = lora.base_identity(cfg.model_dir) if cfg.trainer.lora_rank else None
    if args.load:
        work.load(str(args.load), base)
    steps = []
    for step in range(args.steps):
        result, advantages = work.step(samples_of_step(step + (1 if args.load else 0)))
        params = {}
        # what a push sends: every weight, a LoRA model's with its adapters merged
        for name, t in gathered_named_tensors(model) if args.world_size > 1 else trainable_named_tensors(model):
            if RANK == 0:
                params[name] = t.detach().clone()
        steps.append({"result": dataclasses.asdict(result), "advantages": advantages, "params": params})
        if args.save and step == 0:
            kept = work.save(str(args.save))
            if RANK == 0:
                torch.save(kept, args.save / STATE_FILE)
    if RANK == 0:
        torch.save(steps, args.out)
    if args.world_size > 1:
        import torch.distributed as dist
        dist.barrier()
    return 0


if __name__ == "__main__":
    run(main, "fsdp_step", is_hard_exit="RANK" in os.environ)
    sys.exit(0)
