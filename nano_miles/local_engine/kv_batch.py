"""The running batch's KV cache: per-layer key/value tensors, left-padded, plus the attention mask.
Used by the scheduler; the only module that knows how transformers represents a cache.

Layout: for every layer, keys and values are [batch, kv_heads, seq, head_dim]. Row b holds its
tokens right-aligned: `mask[b, s] == 0` marks left padding. Positions are passed to the model
explicitly (the number of real tokens before each one), so padding never shifts RoPE.

Batch invariance: the cache is always a multiple of ALIGN columns long when a forward starts. A row's
left padding is then congruent to minus its length modulo ALIGN, whatever else is in the batch, so
the vectorised reductions of attention put its real keys in the same lanes and sum them in the same
order alone or batched: its logits are the same bits, and so are the draws of a seeded request.
(Without this, padding moved a row's logprobs by up to ~6e-6, enough to flip a draw now and then.)
"""

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache


def cache_kwarg_name(model) -> str:
    """transformers >= 5.2x calls the forward argument `cache`; earlier 5.x calls it `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def to_transformers_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """Wrap our tensors in a DynamicCache for one forward.

    DynamicCache appends new keys/values with torch.cat, so our tensors are never written in place.
    This and `from_transformers_cache` are the two places to fix if the cache API changes."""
    return DynamicCache(ddp_cache_data=kv)


def from_transformers_cache(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


ALIGN = 16  # columns; 4 was enough on this project's CPUs, 16 leaves room for wider vector units


def aligned_len(num_columns: int) -> int:
    return -(-num_columns // ALIGN) * ALIGN


@dataclass
class KVBatch:
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor  # [batch, seq] int64 on the CPU, 0 = left padding
    num_cached: torch.Tensor  # [batch] int64 on the CPU: real tokens cached = position of the next token

    def select(self, rows: list[int]) -> "KVBatch | None":
        """Keep `rows` (in that order) and drop the left columns that are padding for every kept row
        (a multiple of ALIGN of them)."""
        if not rows:
            return None
        index = torch.tensor(rows)
        mask, num_cached = self.mask.index_select(0, index), self.num_cached.index_select(0, index)
        num_trim = int(mask.shape[1] - num_cached.max()) // ALIGN * ALIGN
        index = index.to(self.kv[0][0].device)
        kv = [(k.index_select(0, index)[:, :, num_trim:], v.index_select(0, index)[:, :, num_trim:])
              for k, v in self.kv]
        return KVBatch(kv, mask[:, num_trim:], num_cached)

    def realigned(self) -> "KVBatch":
        """Back to a multiple of ALIGN columns after a decode step added one: drop the leftmost
        columns if every row has that much padding, else pad up to the next multiple."""
        remainder = self.mask.shape[1] % ALIGN
        if remainder == 0:
            return self
        if self.mask.shape[1] - int(self.num_cached.max()) >= remainder:
            kv = [(k[:, :, remainder:], v[:, :, remainder:]) for k, v in self.kv]
            return KVBatch(kv, self.mask[:, remainder:], self.num_cached)
        return _left_pad(self, aligned_len(self.mask.shape[1]))


def _left_pad(batch: KVBatch, seq_len: int) -> KVBatch:
    num_pad = seq_len - batch.mask.shape[1]
    if num_pad == 0:
        return batch
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, num_pad, 0))  # pads dim -2 (seq) on the left
    kv = [(pad(k), pad(v)) for k, v in batch.kv]
    mask = torch.nn.functional.pad(batch.mask, (num_pad, 0))
    return KVBatch(kv, mask, batch.num_cached)


def merge(a: KVBatch | None, b: KVBatch | None) -> KVBatch | None:
    """Concatenate two batches along the batch dimension (rows of `a` first)."""
    if a is None or b is None:
        return a if b is None else b
    seq_len = max(a.mask.shape[1], b.mask.shape[1])
    a, b = _left_pad(a, seq_len), _left_pad(b, seq_len)
    kv = [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a.kv, b.kv)]
    return KVBatch(kv, torch.cat([a.mask, b.mask]), torch.cat([a.num_cached, b.num_cached]))
