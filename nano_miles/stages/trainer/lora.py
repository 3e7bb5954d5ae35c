"""LoRA: the trainer trains low-rank adapters on frozen base weights (`trainer.lora_rank > 0`, PEFT).

Library module of the trainer (`procs/trainer.py` wraps the model, `checkpoint.py` saves and loads the
adapters, `nano_miles.export` merges them); `tests/test_lora.py` pins it.

Only the adapters train, so only they and their AdamW state live in fp32 beside the gradients; with
`trainer.dtype = "bfloat16"` the frozen base is kept in bf16 too (2 bytes a parameter instead of 16).
The engine keeps serving a plain model: every weight update sends the base weights with each adapted
weight merged, W + (alpha / r) B A, computed from the untouched base with fp32 accumulation
(`weights/named_tensors.py`: `merged_weight`), so SGLang runs with no LoRA kernels and keeps its CUDA graphs,
and merging never drifts the trainer's weights (nothing is merged in place). The KL reference is the same
model with its adapters switched off.
A checkpoint holds the adapters (PEFT's adapter directory), not the base: it names the base by path and
content hash, and a resume or export against another base is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from nano_miles.run.cli import UserError

BASE_FILES = ("*.safetensors", "*.bin", "config.json")  # what a base model's identity is hashed from


def wrap(model, trainer_cfg):
    """`model` with fresh LoRA adapters as `trainer_cfg` asks (PEFT's initialisation: B = 0, so the
    wrapped model computes what the base did); `model` itself when `lora_rank` is 0."""
    t = trainer_cfg
    if not t.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if missing := [n for n in t.lora_target_modules if n not in linear]:
        raise UserError(f"trainer.lora_target_modules names {', '.join(missing)}, which this model has no linear "
                        f"layer of; it has {', '.join(sorted(linear))}")
    if t.dtype == "bfloat16":
        model = model.to(torch.bfloat16)  # the frozen base; PEFT keeps the adapters in fp32
    config = LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                        target_modules=list(t.lora_target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def base_identity(model_dir: str | Path) -> dict:
    """The base model as a checkpoint names it: its path and the SHA-256 of its weights and config."""
    directory = Path(model_dir).resolve()
    digest = hashlib.sha256()
    for pattern in BASE_FILES:
        for path in sorted(directory.glob(pattern)):
            digest.update(path.name.encode())
            with open(path, "rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
    return {"path": str(directory), "sha256": digest.hexdigest()}


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's name, in a checkpoint and an exported adapter


def load_adapters(model, directory: str | Path) -> None:
    """A saved adapter directory's weights into `model`'s adapters, every one of them and nothing else
    (WeightUpdateError naming the first that does not fit: another rank, other target modules)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from nano_miles.weights.named_tensors import WeightUpdateError
    saved = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
    own = {n for n, p in model.named_parameters() if p.requires_grad}
    try:
        result = set_peft_model_state_dict(model, saved)
    except RuntimeError as e:  # a shape that does not fit
        raise WeightUpdateError(f"its adapters do not fit this model's: {str(e).splitlines()[0]}") from None
    missing = [n for n in result.missing_keys if n in own]
    if missing or result.unexpected_keys:
        raise WeightUpdateError(f"its adapters do not match this model's: missing {missing[:3]}, "
                                f"unexpected {list(result.unexpected_keys)[:3]}")
