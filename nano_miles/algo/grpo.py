"""GRPO's data side: token-in-token-out batch assembly, micro-batches, policy logprobs.

Library module; `tests/test_grpo.py` pins every contract below.

Alignment (TITO). A sample is `prompt` (P ids) + `response` (R ids), exactly as the engine saw and
produced them; nothing is re-tokenized. The model reads `input = tokens[:-1]` and predicts
`target = tokens[1:]`, so response token j (0-based) is predicted at position P - 1 + j and the
response occupies prediction positions [P-1, P+R-1): exactly R of them. Loss mask, advantages and
behaviour logprobs are zero on prompt and padding positions, and, in a multi-turn trajectory, on the
tokens its environment wrote between the model's turns (the sample's mask): those are read, not trained.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.checkpoint

from nano_miles.algo.packing import Packing, is_packed


@dataclass
class TokenBatch:
    """Right-padded training batch in prediction positions (length T-1 for T = longest P+R)."""

    input_ids: torch.Tensor       # (B, T-1) int64, tokens[:-1]
    targets: torch.Tensor         # (B, T-1) int64, tokens[1:]
    attention_mask: torch.Tensor  # (B, T-1) int64, 1 on real tokens
    loss_mask: torch.Tensor       # (B, T-1) bool, True exactly on the positions of the response's model tokens
    advantages: torch.Tensor      # (B, T-1) float32, the sample's advantage on loss_mask, else 0
    old_logprobs: torch.Tensor    # (B, T-1) float32, behaviour (engine) logprobs on loss_mask, else 0
    packing: Packing              # the real input tokens laid end to end (a packed forward pass)
    loss_index: torch.Tensor      # (num_tokens,) int64: loss_mask's True positions, flat (row * (T-1) + t)
    num_samples: int              # rows with at least one of them, counted on the host at assembly

    @property
    def num_tokens(self) -> int:
        """The tokens that train (loss_index's length: reading it never waits for the device)."""
        return self.loss_index.numel()

    def to(self, device) -> "TokenBatch":
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in self.__dataclass_fields__
                                            if hasattr(getattr(self, f), "to")})


def assemble_batch(prompts: list, responses: list, logprobs: list, advantages: list,
                   pad_id: int, masks: list | None = None) -> TokenBatch:
    """Build a `TokenBatch` from per-sample token id / logprob arrays and scalar advantages; `masks[i]`
    (bool, R) marks the response tokens that train (None, or a None entry: all of them)."""
    if not (len(prompts) == len(responses) == len(logprobs) == len(advantages)) or not prompts:
        raise ValueError("prompts, responses, logprobs and advantages must be equal, non-empty lists")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths) - 1
    batch = len(prompts)
    tokens = np.full((batch, width + 1), pad_id, dtype=np.int64)
    loss_mask = np.zeros((batch, width), dtype=bool)
    adv = np.zeros((batch, width), dtype=np.float32)
    old = np.zeros((batch, width), dtype=np.float32)
    attention = np.zeros((batch, width), dtype=np.int64)
    for i, (p, r, lp, a, m) in enumerate(zip(prompts, responses, logprobs, advantages, masks or [None] * batch)):
        num_prompt, num_resp = len(p), len(r)
        if num_prompt < 1 or len(lp) != num_resp or (m is not None and len(m) != num_resp):
            raise ValueError(f"sample {i}: need P >= 1 and len(logprobs) == len(mask) == R "
                             f"(P={num_prompt}, R={num_resp}, logprobs={len(lp)}, mask={None if m is None else len(m)})")
        tokens[i, :num_prompt] = p
        tokens[i, num_prompt:num_prompt + num_resp] = r
        span = slice(num_prompt - 1, num_prompt - 1 + num_resp)
        trained = True if m is None else np.asarray(m, bool)
        loss_mask[i, span] = trained
        adv[i, span] = np.where(trained, a, 0.0)
        old[i, span] = np.where(trained, lp, 0.0)
        attention[i, :min(num_prompt + num_resp, width)] = 1  # real input tokens
    return TokenBatch(
        input_ids=torch.from_numpy(tokens[:, :-1].copy()),
        targets=torch.from_numpy(tokens[:, 1:].copy()),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(loss_mask),
        advantages=torch.from_numpy(adv),
        old_logprobs=torch.from_numpy(old),
        packing=Packing.of(attention.sum(axis=1), width),
        loss_index=torch.from_numpy(np.flatnonzero(loss_mask)),
        num_samples=int(loss_mask.any(axis=1).sum()),
    )


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Sample indices grouped into micro-batches of at most `budget` padded tokens (rows x longest).

    Longest first, so each micro-batch holds samples of similar length and little padding; a sample
    longer than the budget is a micro-batch of its own. `budget` 0: one micro-batch of every sample,
    in order (the whole batch at once). Deterministic: ties keep the samples' order.
    """
    if budget <= 0:
        return [list(range(len(lengths)))] if lengths else []
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        # sorted longest first: the first sample of a micro-batch sets its width
        if current and lengths[current[0]] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


# fp32 logits held at once while scoring: 256 MiB. At a 152k vocabulary that is ~440 tokens per chunk
# (on an H200, chunks of ~110 tokens made a 0.5B bf16 step 1.5x slower); at the small policy's 263
# the whole batch is one chunk.
LOGIT_CHUNK_ELEMENTS = 1 << 26
# Compiled (`fused`), 1 GiB: each chunk casts the output head to bf16 again in its recomputation and
# adds its own gradient into the head's fp32 one, so fewer chunks cost less. On an H100 the 0.5B
# shape's compiled step spent 0.76 s in kernels against 0.94 s at 256 MiB, and peaked 0.99 GiB
# higher. Eager chunks, whose log-softmax, exp and gradients are each another tensor of the logits'
# size, stay at 256 MiB: the larger size is not measured there.
FUSED_LOGIT_CHUNK_ELEMENTS = 1 << 28


def _chunk_scores(head, hidden: torch.Tensor, targets: torch.Tensor, scale: float, softcap: float | None,
                  entropy: list | None, entropy_grad: bool = False):
    """Log-probs of `targets` from one chunk of final hidden states. The chunk's entropy is appended to
    `entropy` on the first call only (under activation checkpointing this runs again in the backward
    pass, where nothing but the saved tensors is wanted); with `entropy_grad` it is returned beside the
    log-probs instead, with its gradient (an entropy bonus in the loss)."""
    logits = head(hidden).float()
    if softcap:  # Gemma-style final soft-capping, which the model's own forward applies
        logits = torch.tanh(logits / softcap) * softcap
    if scale != 1.0:  # dividing by exactly 1 is the identity: skip the pass over the vocabulary
        logits = logits / scale
    logp_all = torch.log_softmax(logits, dim=-1)
    picked = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return picked, -(logp_all.exp() * logp_all).sum(-1)
    if entropy is not None and not entropy:
        with torch.no_grad():  # a diagnostic: nothing is kept for the backward pass
            entropy.append(-(logp_all.exp() * logp_all).sum(-1))
    return picked


@functools.cache
def _fused_chunk_scores():
    """`_chunk_scores` through torch.compile (built on first use): the cast, softmax, gather and entropy
    each pass over a chunk's whole vocabulary in eager mode; compiled, they share a few kernels."""
    return torch.compile(_chunk_scores, dynamic=True)


def token_scores(model, input_ids: torch.Tensor, targets: torch.Tensor, attention_mask: torch.Tensor,
                 temperature: float = 1.0, positions: torch.Tensor | None = None,
                 with_entropy: bool = False, entropy_grad: bool = False,
                 packing: Packing | None = None, index: torch.Tensor | None = None, fused: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log pi(target_t | tokens_<=t), entropy of pi(. | tokens_<=t) or None without `with_entropy`)
    at every position, in fp32, as the engine computes them; 0 off `positions` (a (B, T-1) bool mask;
    None = everywhere). With `entropy_grad` the entropy carries its gradient (else it is a diagnostic).

    The engine reports log_softmax(logits / T) of the un-truncated distribution (T < 1e-6 means greedy,
    reported at T = 1), so the trainer divides by the same T before the softmax.

    Memory: the full-vocabulary logits of a whole batch never exist. The final hidden states are
    taken at `positions` only, and the output head and log-softmax run over chunks of them
    (LOGIT_CHUNK_ELEMENTS); with gradients on, each chunk is recomputed in the backward pass instead
    of being kept, so one chunk's logits are alive at a time. Entropy costs no extra memory.

    With `packing` (the batch's) and a model switched to packed attention (`algo/packing.py`), the
    forward pass runs on the real tokens only, laid end to end, and its hidden states are put back in
    the padded layout. `index` (the batch's `loss_index` for `positions` = its loss mask) names the
    positions by flat index, counted on the host: then nothing here waits for the device.

    `fused` (a GPU trainer with `trainer.compile`): the chunks are scored by torch.compile's kernels,
    FUSED_LOGIT_CHUNK_ELEMENTS at a time.
    """
    # Through the model's own forward (so FSDP's and other wrappers' hooks run), with the output head
    # on the last position only: the head runs here, chunk by chunk, on the final hidden states.
    if packing is not None and is_packed(model):
        hidden = model(input_ids=packing.pack(input_ids), use_cache=False, output_hidden_states=True,
                       logits_to_keep=1, **packing.model_kwargs()).hidden_states[-1]
        hidden = packing.unpack(hidden, tuple(input_ids.shape))
    else:
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                       output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
    if positions is None:
        positions = torch.ones_like(targets, dtype=torch.bool)
    if index is None:
        rows, wanted = hidden[positions], targets[positions]  # (a boolean index: waits for the device)
    else:  # the same rows in the same order
        rows, wanted = hidden.flatten(0, 1).index_select(0, index), targets.flatten().index_select(0, index)
    head = model.get_output_embeddings()
    scale = temperature if temperature >= 1e-6 else 1.0
    softcap = getattr(model.config, "final_logit_softcapping", None)
    chunk = max(1, (FUSED_LOGIT_CHUNK_ELEMENTS if fused else LOGIT_CHUNK_ELEMENTS) // head.weight.shape[0])
    recompute = torch.is_grad_enabled() and len(rows) > chunk
    score = _fused_chunk_scores() if fused else _chunk_scores
    logps, entropies = [], []
    for start in range(0, len(rows), chunk):
        entropy = [] if with_entropy and not entropy_grad else None
        args = (head, rows[start:start + chunk], wanted[start:start + chunk], scale, softcap, entropy, entropy_grad)
        out = torch.utils.checkpoint.checkpoint(score, *args, use_reentrant=False) if recompute else score(*args)
        if entropy_grad:
            out, chunk_entropy = out
            entropy = [chunk_entropy]
        logps.append(out)
        entropies += entropy or []

    def spread(values: list[torch.Tensor]) -> torch.Tensor:  # back to (B, T-1), 0 off `positions`
        out = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
        if not values:
            return out
        if index is None:
            return out.masked_scatter(positions, torch.cat(values))
        return out.flatten().index_copy(0, index, torch.cat(values)).view(targets.shape)
    return spread(logps), spread(entropies) if with_entropy or entropy_grad else None


def token_logprobs(model, input_ids: torch.Tensor, targets: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The log-probs of `token_scores`, without entropy."""
    return token_scores(model, input_ids, targets, attention_mask, temperature, positions)[0]
