"""Named weight tensors as both sides of every transport see them: which to send, how to load them.

Library module shared by the trainer-side senders, the engine-side receivers and the trainer's
checkpoints; it imports no transport, so neither side pulls in the other's code.
"""

from __future__ import annotations

from pathlib import Path

import torch


class WeightUpdateError(ValueError):
    """A weight payload that cannot be applied; nothing was changed in the model."""


def tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that alias another parameter (e.g. a tied lm_head): never sent or loaded."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        else:
            seen[id(p)] = name
    return aliases


def has_adapters(model: torch.nn.Module) -> bool:
    """Does `model` carry LoRA adapters (a PEFT model, `stages/trainer/lora.py`)?"""
    return hasattr(model, "peft_config")


def is_sharded(model: torch.nn.Module) -> bool:
    """Are `model`'s parameters split over ranks (FSDP2's DTensors, `stages/trainer/sharded.py`)?"""
    return hasattr(next(model.parameters()), "full_tensor")


def trainable_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors an update sends: each parameter once, tied aliases left out; of a model with LoRA
    adapters (PEFT's), the base model's with the adapters merged in (the engine serves a plain model)."""
    if has_adapters(model):
        return list(merged_named_tensors(model))
    return [(name, p.detach()) for name, p in model.named_parameters()]


def base_parts(model):
    """(name, parameter, layer) for each of a PEFT model's base parameters, under the base model's own
    names: `layer` is the LoRA layer whose weight the parameter is (to be merged), else None."""
    base = model.get_base_model()
    modules = dict(base.named_modules())
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if not owner:
            yield name, p, None
        else:
            yield f"{owner}.{leaf}", p, modules[owner] if leaf == "weight" else None


def merged_named_tensors(model, full=lambda t: t):
    """The base model's parameters under its own names, each adapted weight merged in fp32:
    W + scale B A, one at a time as they are asked for (a generator: a 7B model's merged weights
    would take 26 GB at once). The model's own tensors are not changed. `full(tensor)`: the whole
    tensor of a parameter (a sharded model's: gathered from every rank, in this order on each)."""
    for name, p, layer in base_parts(model):
        yield name, full(p.detach()) if layer is None else merged_weight(layer, full)


def merged_weight(layer, full=lambda t: t, out: torch.Tensor | None = None) -> torch.Tensor:
    """One PEFT LoRA linear layer's weight with its active adapters added: a copy of the base takes each
    B A in place (one GEMM with beta 1, accumulating in fp32): no full-size temporaries for B A and its
    scaling, a third of the time of `w + scale * (b @ a)` on a 1.5B-shape MLP weight, with the same
    result. In fp32, or written into `out` in its dtype: a bf16 `out` (the flat push's buffer) gets
    W + scale B A rounded once from a bf16 base, with A and B rounded to bf16 as the trainer's autocast
    rounds them, and no fp32 copy of the weight: 8 bytes of memory traffic a parameter, not 20."""
    with torch.no_grad():
        w = full(layer.base_layer.weight.detach())
        if out is None:
            out = w.to(torch.float32, copy=True)  # never the model's own tensor
        else:
            out.copy_(w)
        for adapter in layer.active_adapters:
            a, b = (full(m[adapter].weight.detach()).to(out.dtype) for m in (layer.lora_A, layer.lora_B))
            out.addmm_(b, a, alpha=layer.scaling[adapter])
    return out


def split_into_buckets(named, max_bucket_bytes: int):
    """(bucket, is_last) over (name, tensor) pairs, each bucket at most `max_bucket_bytes` unless one
    tensor is larger; lazy: a generator of gathered tensors is read one bucket (and one tensor) ahead."""
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket, True


# What a float parameter takes: torch can check these for finiteness on every device it loads from.
LOADABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def plan_copy(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> list:
    """Check (name, tensor) pairs against `model`'s parameters; the (parameter, tensor) pairs to copy.

    Every name, shape, dtype, device and value is checked here, before `copy_planned` copies anything,
    so a bad update leaves the model untouched: a WeightUpdateError names the first tensor that does
    not fit. A tied alias (lm_head.weight when embeddings are tied) is skipped, as SGLang does.
    """
    params = dict(model.named_parameters())
    skip = tied_names(model)
    plan = []
    for name, t in named:
        if name in skip:
            continue
        if name not in params:
            raise WeightUpdateError(f"unknown parameter {name!r}")
        param = params[name]
        if tuple(t.shape) != tuple(param.shape):
            raise WeightUpdateError(f"{name}: shape {tuple(t.shape)} != {tuple(param.shape)}")
        if t.dtype not in LOADABLE_DTYPES:
            raise WeightUpdateError(f"{name}: dtype {t.dtype} is not one of {[str(d) for d in LOADABLE_DTYPES]}")
        if t.device.type not in ("cpu", param.device.type):  # a meta tensor holds no values at all
            raise WeightUpdateError(f"{name}: a tensor on device {t.device} cannot load into {param.device}")
        # One reduction instead of an elementwise mask (10x cheaper): NaN or inf anywhere makes
        # the sum non-finite; finite weights never come near float overflow.
        if not torch.isfinite(t.sum()):
            raise WeightUpdateError(f"{name}: values must be finite floats")
        plan.append((param, t))
    return plan


def copy_planned(plan: list) -> int:
    """Copy what `plan_copy` checked into the parameters; returns how many were loaded."""
    with torch.no_grad():
        for param, t in plan:
            param.copy_(t)
    return len(plan)


def copy_into_model(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> int:
    """Check, then copy (name, tensor) pairs into `model`'s parameters; returns how many were loaded."""
    return copy_planned(plan_copy(model, named))


def read_safetensors_dir(model_path: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file of an HF directory (a checkpoint), by name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {model_path}")
    named = []
    try:
        for f in files:
            named += list(load_file(str(f)).items())
    except (SafetensorError, OSError) as e:
        raise WeightUpdateError(f"cannot read {model_path}: {e}") from None
    return named


def load_safetensors_dir(model: torch.nn.Module, model_path: str) -> int:
    """Every *.safetensors file of an HF directory into `model` (a checkpoint)."""
    return copy_into_model(model, read_safetensors_dir(model_path))
