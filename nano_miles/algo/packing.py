"""Packed micro-batches: a micro-batch's samples laid end to end, attention kept inside each sample.

Library module of `grpo.token_scores`; `tests/test_packing.py` pins it against the padded batch.

A padded micro-batch spends compute on pad tokens and, because it needs an attention mask, runs
attention through a masked kernel. Packed, the rows' real tokens form one sequence (1, N) with each
token's position inside its own sample (`position_ids`, so RoPE sees the same angles) and the
sample boundaries as cumulative lengths (`cu_seqlens`, FlashAttention's convention); the attention
function attends within each sample only, causally. The outputs at a sample's tokens are the
padded batch's up to rounding, and `unpack` puts them back in the padded layout, so everything after
the model (log-probs, losses, masks) is unchanged.

The attention function that keeps each sample to itself is the trainer's
(`stages/trainer/packed_attention.py`, which switches a model to it); `token_scores` packs a batch for
a model so switched, and only then.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ATTENTION = "nano_miles_packed"  # the name under which transformers finds the attention function


@dataclass
class Packing:
    """Where a right-padded batch's real tokens go when packed; built on the host, so using it never
    waits for the device."""

    index: torch.Tensor         # (N,) int64: each packed token's flat position (row * width + t) in the batch
    position_ids: torch.Tensor  # (1, N) int64: its position inside its sample
    cu_seqlens: torch.Tensor    # (B + 1,) int32: where each sample starts in the packed sequence, then N
    max_length: int             # the longest sample's length

    @classmethod
    def of(cls, lengths, width: int) -> "Packing":
        """The packing of rows with `lengths` real tokens each (at the start of rows `width` wide)."""
        lengths = np.asarray(lengths, np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        positions = np.concatenate([np.arange(n) for n in lengths]) if len(lengths) else np.zeros(0, np.int64)
        rows = np.repeat(np.arange(len(lengths)), lengths)
        return cls(index=torch.from_numpy(rows * width + positions), position_ids=torch.from_numpy(positions)[None],
                   cu_seqlens=torch.from_numpy(starts.astype(np.int32)), max_length=int(lengths.max(initial=0)))

    @property
    def num_tokens(self) -> int:
        return self.index.numel()

    def to(self, device) -> "Packing":
        return Packing(self.index.to(device, non_blocking=True), self.position_ids.to(device, non_blocking=True),
                       self.cu_seqlens.to(device, non_blocking=True), self.max_length)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, W, ...) -> (1, N, ...): the real tokens, row after row."""
        return padded.reshape(-1, *padded.shape[2:]).index_select(0, self.index)[None]

    def unpack(self, packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """(1, N, ...) -> (B, W, ...) with zeros at the pads: the inverse of `pack` on the real tokens."""
        flat = packed[0]
        out = flat.new_zeros((shape[0] * shape[1], *flat.shape[1:]))
        return out.index_copy(0, self.index, flat).view(*shape, *flat.shape[1:])

    def model_kwargs(self) -> dict:
        """What the model's forward passes down to `attention` (transformers' FlashAttention kwargs)."""
        return dict(position_ids=self.position_ids, cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                    max_length_q=self.max_length, max_length_k=self.max_length)


def is_packed(model) -> bool:
    """Is `model` switched to the packed attention function (by the trainer, on a GPU)?"""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTENTION
