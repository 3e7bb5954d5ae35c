"""The packed attention function: one sequence of samples laid end to end, each attending only to itself.

Library module of the trainer's learner (`enable` on a CUDA device); `tests/test_packing.py` and
`tests/test_gpu_learner.py` check it against the padded batch.

A packed micro-batch (`algo/packing.py`) is one sequence (1, N) with the sample boundaries as cumulative
lengths (`cu_seqlens`); transformers passes them to the attention function as FlashAttention's kwargs.
On a CUDA device with bf16/fp16 activations (autocast's) this calls PyTorch's variable-length
FlashAttention (`torch.nn.attention.varlen`); elsewhere (the CPU, fp32) a loop of causal
scaled-dot-product attention over the samples: slower, the same function. The learner enables it on
CUDA only: the CPU keeps the padded batch, bit for bit the numbers it always had.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from nano_miles.algo.packing import ATTENTION


@functools.cache  # asked by every layer of every forward pass: looked up once
def _flash_varlen():
    """PyTorch's variable-length FlashAttention and how to ask it for causal attention, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}  # PyTorch 2.10 / 2.11+
    return varlen_attn, causal, "scale" in params


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """transformers' attention-function contract: query (1, Hq, N, D), key/value (1, Hkv, N, D) of one
    packed sequence; returns ((1, N, Hq, D), None). A call without `cu_seq_lens_q` (a padded batch) goes
    to transformers' own scaled-dot-product attention."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if sliding_window is not None or dropout:
        raise ValueError("packed attention supports full causal attention without dropout only")
    head_dim = query.shape[-1]
    if scaling is None:
        scaling = head_dim ** -0.5
    groups = query.shape[1] // key.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, H, D)
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if q.is_cuda and torch.is_autocast_enabled("cuda"):  # as autocast runs scaled-dot-product attention:
        low = torch.get_autocast_dtype("cuda")          # in its low precision (RoPE left q, k in fp32)
        q, k, v = q.to(low), k.to(low), v.to(low)
    flash = _flash_varlen() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    if flash is not None and (flash[2] or abs(scaling - head_dim ** -0.5) < 1e-12):
        varlen_attn, causal, takes_scale = flash
        m = kwargs["max_length_q"]
        out = varlen_attn(q, k, v, cu, cu, m, m, **causal, **({"scale": scaling} if takes_scale else {}))
    else:  # one sample at a time: the same attention, no kernel needed
        bounds = cu.tolist()
        out = torch.cat([F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
            scale=scaling).transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])])
    return out[None], None


def can_pack(model) -> bool:
    """Can `model` run packed: a transformers model whose layers all attend fully and causally."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return False
    if getattr(config, "use_sliding_window", False) or getattr(config, "attn_logit_softcapping", None):
        return False
    return all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])


def enable(model) -> bool:
    """Switch `model` to packed attention where it can run it; whether it did."""
    if not can_pack(model):
        return False
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION, attention)
    model.set_attn_implementation(ATTENTION)
    return True
