"""The policy split over the trainer's ranks (FSDP2), and the work every rank does together.

Library module used by the learner (sharding, the sums over ranks), the step loop (`Work`, through
`ranks.Ranks.together`) and the peers (`gathered_named_tensors`, a weight push).

* `shard`: `fully_shard` on each decoder layer (the classes transformers keeps whole,
  `_no_split_modules`), then on the root, which keeps the embeddings, the final norm and a tied head
  together. Every parameter becomes a DTensor holding this rank's rows.
* A weight push gathers one full tensor at a time (`gathered_named_tensors`); rank 0 hands them to the
  engine's transport in buckets and the other ranks drop each one at once, so no rank holds more than
  a bucket beyond its shard.
* A checkpoint keeps the full weights as a Hugging Face directory (rank 0 writes it from one gather:
  export and SGLang take it as it is) and the optimizer's state with torch.distributed.checkpoint
  in an `optimizer` folder, each rank writing its own shard; both load into any number of ranks, one
  plain process included.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from nano_miles.stages.trainer.checkpoint import OPTIMIZER_DIR, STATE_FILE, load_model, save_model
from nano_miles.weights.named_tensors import (WeightUpdateError, has_adapters, is_sharded, merged_named_tensors,
                                              plan_copy, read_safetensors_dir, tied_names)

log = logging.getLogger("trainer")


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """fully_shard each decoder layer, then the root."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    # transformers' forward returns views of its outputs; nothing here changes them in place
    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor", UserWarning)
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    for layer in [m for m in model.modules() if type(m).__name__ in kinds]:
        fully_shard(layer)
    fully_shard(model)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Back to this rank's rows: a forward pass without a backward (no_grad) leaves the root unit's
    parameters gathered in full, as plain tensors."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over the ranks (the same on every rank); itself on one."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


def all_items(items: list) -> list:
    """Every rank's `items` (small, picklable), rank by rank; `items` itself on one rank."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for rank_items in out for x in rank_items]


def gathered_named_tensors(model: torch.nn.Module, tell=None, dtype: torch.dtype | None = None):
    """(name, full tensor) for every tensor a push sends from a sharded model (a LoRA model's: the
    base's with the adapters merged, `merged_named_tensors`), each gathered from all ranks as it is
    asked for and cast to `dtype` (a full fine-tune's before the gather: less to move). Every rank
    must walk all of them: `tell` (rank 0's `Ranks.tell`) has the others start their walk; closed
    early (the engine failed mid-push), rank 0 still takes part in the gathers left."""
    if tell is not None:
        tell("push")
    reshard(model)
    if has_adapters(model):
        walk = ((n, t.to(dtype or t.dtype)) for n, t in merged_named_tensors(model, lambda t: t.full_tensor()))
    else:
        walk = ((n, p.detach().to(dtype or p.dtype).full_tensor()) for n, p in model.named_parameters())
    try:
        yield from walk
    finally:
        for _ in walk:  # the gathers the other ranks still make
            pass


def save_weights(model: torch.nn.Module, optimizer, directory: Path, is_leader: bool) -> None:
    """Every rank: the full weights (rank 0 writes the HF files) and each rank's optimizer shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    reshard(model)
    is_lora = has_adapters(model)  # a LoRA model's checkpoint holds its adapters alone (PEFT's directory)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=is_lora))
    if is_leader:
        skip = tied_names(model)
        model.save_pretrained(directory, state_dict={k: v for k, v in full.items()
                                                     if (".lora_" in k if is_lora else k not in skip)})
    del full
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=directory / OPTIMIZER_DIR)


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Every rank: the checkpoint's full weights, each rank keeping its rows; checked first (names,
    shapes, finite values: a WeightUpdateError leaves the model as it was)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    named = read_safetensors_dir(str(directory))
    plan_copy(model, named)
    set_model_state_dict(model, dict(named), options=StateDictOptions(full_state_dict=True, strict=False))


def load_adapters(model: torch.nn.Module, directory: Path) -> None:
    """Every rank: a LoRA checkpoint's adapters (PEFT's file: names without the adapter's), each rank
    keeping its rows; every adapter must be there with its shape (a WeightUpdateError otherwise)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from nano_miles.stages.trainer.lora import ADAPTER_WEIGHTS
    saved = load_file(str(directory / ADAPTER_WEIGHTS))
    full = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.", name)  # PEFT drops the adapter's name
            if key not in saved or tuple(saved[key].shape) != tuple(p.shape):
                raise WeightUpdateError(f"its adapters do not match this model's at {key}")
            full[name] = saved[key]
    if len(full) != len(saved):
        raise WeightUpdateError(f"it holds {len(saved)} adapter tensors, this model has {len(full)}")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def load_optimizer(model: torch.nn.Module, optimizer, directory: Path, saved: dict) -> None:
    """The optimizer's state from a checkpoint: its sharded `optimizer` folder (any world size, one plain
    process included), or a one-process checkpoint's `saved["optimizer"]` (torch's format, parameters by
    position) onto this rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    if (directory / OPTIMIZER_DIR).is_dir():
        import torch.distributed.checkpoint as dcp
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # this layout's template
        dcp.load(state, checkpoint_id=directory / OPTIMIZER_DIR)
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return
    if "optimizer" not in saved:
        raise WeightUpdateError(f"no optimizer state (neither {OPTIMIZER_DIR}/ nor one in the trainer state)")
    positional = saved["optimizer"]
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # the order the optimizer was built in
    full = {"state": {names[i]: s for i, s in positional["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in positional["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))


class Work:
    """What every rank of the trainer does together, by name (`ranks.Ranks.together`); with one plain
    process, what that process does. `model` and `learner` are this rank's."""

    # what a command may fail with on every rank alike, rank 0 then trying something else (a load: an
    # older checkpoint); any other failure ends the rank
    RETRIED = {"load": (WeightUpdateError, OSError, RuntimeError, ValueError, KeyError)}

    def __init__(self, model: torch.nn.Module, learner, rank: int = 0):
        self.model, self.learner, self.rank = model, learner, rank

    def step(self, samples):
        return self.learner.step(samples)

    def push(self) -> None:
        """A rank other than 0's part in a weight push: every gather, nothing kept."""
        for _ in gathered_named_tensors(self.model):
            pass

    def probe(self, token_ids: list[int]) -> torch.Tensor:
        """The model's log-probs of `token_ids[1:]` after `token_ids[:1]`..., one forward pass."""
        from nano_miles.algo.grpo import token_logprobs
        device = self.learner.device
        ids = torch.tensor([token_ids], device=device)
        with torch.no_grad():
            self.model.eval()
            return token_logprobs(self.model, ids[:, :-1], ids[:, 1:], torch.ones_like(ids[:, :-1]))[0].cpu()

    def save(self, directory: str) -> dict:
        """The model's files into `directory`; the learner's state for the trainer state file."""
        directory = Path(directory)
        if not is_sharded(self.model):
            return save_model(directory, self.model, self.learner)
        save_weights(self.model, self.learner.optimizer, directory, self.rank == 0)
        return self.learner.state_dict()

    def load(self, directory: str, base: dict | None, saved: dict | None = None) -> None:
        """The checkpoint's weights (a LoRA model's adapters) and the learner's state, which
        `checkpoint.load_checkpoint` has checked; `saved`: its trainer state file, where this rank
        has read it already (rank 0)."""
        directory = Path(directory)
        if saved is None:
            saved = torch.load(directory / STATE_FILE, weights_only=True)
        if not is_sharded(self.model):
            return load_model(directory, self.model, self.learner, saved, base)
        if base:
            load_adapters(self.model, directory)
        else:
            load_weights(self.model, directory)
        self.learner.load_state_dict(saved, directory)
