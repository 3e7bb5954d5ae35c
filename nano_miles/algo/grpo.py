"""GRPO's data side: group-relative advantages, token-in-token-out batch assembly, policy logprobs.

Library module; `tests/test_grpo.py` pins every contract below.

Alignment (TITO). A sample is `prompt` (P ids) + `response` (R ids), exactly as the engine saw and
produced them; nothing is re-tokenized. The model reads `input = tokens[:-1]` and predicts
`target = tokens[1:]`, so response token j (0-based) is predicted at position P - 1 + j and the
response occupies prediction positions [P-1, P+R-1): exactly R of them. Loss mask, advantages and
behaviour logprobs are zero on prompt and padding positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ZERO_STD = 1e-7  # a group whose reward std is below this carries no signal: its advantages are 0


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(num_groups, G) rewards -> (num_groups, G) advantages, whitened inside each group.

    A_i = (R_i - mean) / (std + eps), with the population std (a 1-sample group has std 0), and
    A_i = 0 exactly when std < ZERO_STD: all-equal groups must not amplify float noise into signal.
    """
    if rewards.ndim != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must be (num_groups, G>=1), got {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64)  # whiten in double: tiny spreads stay exact
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    adv = (rewards - mean) / (std + eps)
    return torch.where(std < ZERO_STD, torch.zeros_like(adv), adv).to(torch.float32)


@dataclass
class TokenBatch:
    """Right-padded training batch in prediction positions (length T-1 for T = longest P+R)."""

    input_ids: torch.Tensor       # (B, T-1) int64, tokens[:-1]
    targets: torch.Tensor         # (B, T-1) int64, tokens[1:]
    attention_mask: torch.Tensor  # (B, T-1) int64, 1 on real tokens
    loss_mask: torch.Tensor       # (B, T-1) bool, True exactly on the response's R positions
    advantages: torch.Tensor      # (B, T-1) float32, the sample's advantage on loss_mask, else 0
    old_logprobs: torch.Tensor    # (B, T-1) float32, behaviour (engine) logprobs on loss_mask, else 0

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device) -> "TokenBatch":
        return TokenBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def assemble_batch(prompts: list, responses: list, logprobs: list, advantages: list,
                   pad_id: int) -> TokenBatch:
    """Build a `TokenBatch` from per-sample token id / logprob arrays and scalar advantages."""
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
    for i, (p, r, lp, a) in enumerate(zip(prompts, responses, logprobs, advantages)):
        num_prompt, num_resp = len(p), len(r)
        if num_prompt < 1 or len(lp) != num_resp:
            raise ValueError(f"sample {i}: need P >= 1 and len(logprobs) == R "
                             f"(P={num_prompt}, R={num_resp}, logprobs={len(lp)})")
        tokens[i, :num_prompt] = p
        tokens[i, num_prompt:num_prompt + num_resp] = r
        span = slice(num_prompt - 1, num_prompt - 1 + num_resp)
        loss_mask[i, span] = True
        adv[i, span] = a
        old[i, span] = lp
        attention[i, :min(num_prompt + num_resp, width)] = 1  # real input tokens
    return TokenBatch(
        input_ids=torch.from_numpy(tokens[:, :-1].copy()),
        targets=torch.from_numpy(tokens[:, 1:].copy()),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(loss_mask),
        advantages=torch.from_numpy(adv),
        old_logprobs=torch.from_numpy(old),
    )


def token_logprobs(model, input_ids: torch.Tensor, targets: torch.Tensor,
                   attention_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target_t | tokens_<=t) for every position, in fp32, as the engine computes them.

    The engine reports log_softmax(logits / T) of the un-truncated distribution (T < 1e-6 means
    greedy, reported at T = 1), so the trainer divides by the same T before the softmax.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    scale = temperature if temperature >= 1e-6 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
