"""The flat GPU transport, engine side: SGLang's custom weight loader that maps one trainer-owned buffer.

SGLang calls `load_flat` when started with `--custom-weight-loader nano_miles.weights.flat_receiver.load_flat`
(`nano_miles/engine/launch.py` adds it); the trainer side is `flat_sender.py`. This module defines the
buffer layout both sides use (`flat_view`).

SGLang's stock CUDA-IPC path builds a new `FlattenedTensorBucket` for every update, opens a new IPC
mapping in the engine and runs the model's `Model.load_weights` (a Python call per tensor). Here the
trainer keeps one persistent buffer in the engine's dtype, laid out by HF parameter name. Each update:

1. trainer: copy the parameters into the buffer (multi-tensor copy, casting to the engine dtype),
   `torch.cuda.synchronize()` (the engine reads it from another process, on its own streams);
2. post a payload of one tensor, the whole buffer, named by its layout (JSON of name, byte offset,
   shape, dtype). Torch caches the engine's mapping of an IPC handle while the mapped storage is
   alive, and `load_flat` keeps it alive, so only the first update opens the mapping;
3. engine: on a layout or buffer it has not seen, build a copy plan (HF names -> slices of SGLang's
   fused `qkv_proj` / `gate_up_proj` parameters, tied `lm_head` skipped); then one multi-tensor copy
   from the buffer into the parameters and a device synchronize before answering, so the trainer may
   overwrite the buffer as soon as the answer arrives.

The payload describes itself, so an engine restarted by supervisord simply builds its plan again.
Tensor parallelism 1 only (the fused slices below are those of one rank).
"""

from __future__ import annotations

import json
import re

import torch

ALIGN_BYTES = 256  # every tensor starts on a 256-byte boundary: aligned vector loads on both sides

# HF name part -> (fused SGLang name part, index among the parts fused into it)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_FUSED_NAME = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


def flat_view(flat: torch.Tensor, offset: int, shape: list[int], dtype_name: str) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    numel = 1
    for n in shape:
        numel *= n
    return flat[offset:offset + numel * dtype.itemsize].view(dtype).view(shape)


class _Plan:
    def __init__(self, key: tuple, mapped: torch.Tensor, dst: list, src: list):
        self.key, self.mapped, self.dst, self.src = key, mapped, dst, src


_PLAN: _Plan | None = None  # the engine's current plan; holds the mapped buffer (keeps the mapping)


def build_plan(model: torch.nn.Module, layout: list, flat: torch.Tensor) -> tuple[list, list]:
    """(destinations, sources): views into the model's parameters and into `flat`, pairwise equal
    in shape. Raises ValueError naming the first tensor that does not fit the served model."""
    params = dict(model.named_parameters())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    rows = {entry[0]: entry[2][0] for entry in layout}
    dst, src, covered = [], [], set()
    for name, offset, shape, dtype_name in layout:
        if name == "lm_head.weight" and tied:
            continue  # SGLang's lm_head is the embedding itself
        target, start = name, 0
        m = _FUSED_NAME.match(name)
        if name not in params and m:
            prefix, part, kind = m.groups()
            fused, index = _FUSED[part]
            target = f"{prefix}.{fused}.{kind}"
            siblings = [p for p, (f, _) in _FUSED.items() if f == fused]
            start = sum(rows[f"{prefix}.{s}.{kind}"] for s in siblings[:index])
        if target not in params:
            raise ValueError(f"{name}: the served model has no parameter {target}")
        param = params[target]
        # dim-0 slice: a fused part, or the real rows of a vocabulary padded for the kernels
        is_fit = len(shape) == param.dim() and (not shape or (
            start + shape[0] <= param.shape[0] and list(shape[1:]) == list(param.shape[1:])))
        if not is_fit:
            raise ValueError(f"{name}: shape {shape} does not fit {target} {list(param.shape)}")
        region = param.data.narrow(0, start, shape[0]) if shape else param.data
        dst.append(region)
        src.append(flat_view(flat, offset, shape, dtype_name))
        covered.add(target)
    missing = sorted(set(params) - covered)
    if missing:
        raise ValueError(f"the update leaves parameters unset: {missing[:5]}")
    return dst, src


def load_flat(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang custom weight loader: `named_tensors` is [(layout JSON, whole flat uint8 buffer)]."""
    global _PLAN
    if len(named_tensors) != 1:
        raise ValueError(f"load_flat expects one (layout, buffer) pair, got {len(named_tensors)}")
    layout_key, flat = named_tensors[0]
    key = (layout_key, flat.data_ptr(), flat.numel())
    if _PLAN is None or _PLAN.key != key:
        dst, src = build_plan(model, json.loads(layout_key), flat)
        _PLAN = _Plan(key, flat, dst, src)
    with torch.no_grad():
        torch._foreach_copy_(_PLAN.dst, _PLAN.src)
    # The trainer overwrites the buffer for the next update once this call has answered.
    torch.cuda.synchronize()
