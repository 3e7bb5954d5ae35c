"""A check of one training step on several devices: FSDP2 (`fully_shard`) over torchrun ranks.
Check: `torchrun --nproc-per-node 2 -m harness.fsdp_step OUT.pt` (gloo on CPU) vs `python -m harness.fsdp_step OUT.pt`.
Not part of the pipeline yet (docs/scale-out.md says what wiring it into the trainer stage takes).

Each rank holds a shard of every parameter and trains on its slice of the batch. `policy_loss` is a
masked token mean, and FSDP averages gradients over ranks, so each rank's loss is scaled by
num_world * local_tokens / global_tokens: the averaged gradient is then the single-process one.
Before a weight push every rank joins the all-gather (`full_named_tensors`); only rank 0 keeps the
result and sends it, so the control channel, the engines and the weight group see one trainer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, run


def init_ranks() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; joins the default group when there are several."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":  # GPU only: one device per local rank
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    return rank, world


def shard_policy(model: torch.nn.Module) -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, norm, tied head stay together)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def full_named_tensors(model: torch.nn.Module, rank: int) -> list[tuple[str, torch.Tensor]]:
    """Every rank gathers each full parameter (a collective); rank 0 gets them all, others []."""
    named = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if rank == 0:
            named.append((name, full.detach()))
    return named


def local_slice(num_samples: int, rank: int, world: int) -> slice:
    """This rank's contiguous share of the batch's samples."""
    per_rank = -(-num_samples // world)
    return slice(rank * per_rank, min(num_samples, (rank + 1) * per_rank))


def train_step(model, optimizer, batch, loss_cfg, temperature: float, max_grad_norm: float,
               rank: int, world: int) -> tuple[float, float]:
    """One optimizer step on this rank's slice of `batch` (an `assemble_batch` result, all samples).

    Returns (global loss, grad norm), the same on every rank."""
    import torch
    import torch.distributed as dist

    from nano_miles.algo.grpo import token_logprobs
    from nano_miles.algo.loss import policy_loss

    part = local_slice(batch.input_ids.shape[0], rank, world)
    logp = token_logprobs(model, batch.input_ids[part], batch.targets[part], batch.attention_mask[part],
                          temperature)
    out = policy_loss(logp, batch.old_logprobs[part], batch.advantages[part], batch.loss_mask[part], loss_cfg)
    num_local = batch.loss_mask[part].sum().float()
    num_global = batch.loss_mask.sum().float()
    loss = out.loss * (world * num_local / num_global)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    total = loss.detach() / world
    if world > 1:
        dist.all_reduce(total)
    return float(total), float(grad_norm)


def main(argv: list[str]) -> int:
    """One step on a fixed synthetic batch with the project's policy; rank 0 saves the new weights."""
    parser = ArgumentParser(prog="python -m harness.fsdp_step", description=__doc__)
    parser.add_argument("out", type=Path, help="file for rank 0's loss, grad norm and new weights (torch.save)")
    out = parser.parse_args(argv).out
    import torch  # after the flags: --help answers at once
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from harness.policy import ensure_policy
    from nano_miles.algo.grpo import assemble_batch
    from nano_miles.algo.loss import LossConfig

    torch.set_num_threads(1)
    rank, world = init_ranks()
    model = AutoModelForCausalLM.from_pretrained(ensure_policy(), dtype=torch.float32)
    if world > 1:
        shard_policy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    num_samples = 8
    prompts = [torch.randint(2, 60, (5,), generator=gen).tolist() for _ in range(num_samples)]
    responses = [torch.randint(2, 60, (3 + i % 4,), generator=gen).tolist() for i in range(num_samples)]
    logprobs = [(-torch.rand(len(r), generator=gen) - 1.0).tolist() for r in responses]
    advantages = torch.randn(num_samples, generator=gen).tolist()
    batch = assemble_batch(prompts, responses, logprobs, advantages, pad_id=0)
    loss, grad_norm = train_step(model, optimizer, batch, LossConfig(), 1.0, 1.0, rank, world)
    named = full_named_tensors(model, rank)
    if rank == 0:
        torch.save({"loss": loss, "grad_norm": grad_norm, "params": dict(named)}, out)
    if world > 1:
        # Every rank waits until rank 0 has saved, then leaves without tearing gloo down: its
        # destructors were seen to abort a rank now and then ("terminate called without an active
        # exception") after all the work was done, even with the group destroyed after a barrier.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    run(main, "fsdp_step")
