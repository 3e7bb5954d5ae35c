"""The dual-clip PPO policy-gradient loss used by GRPO, with the diagnostics a run should log.

Library module; `tests/test_loss.py` pins its behaviour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nano_miles.algo.diagnostics import LossDiagnostics


@dataclass
class LossConfig:
    eps_clip: float = 0.2         # lower clip: ratio floor 1 - eps_clip
    eps_clip_high: float = 0.28   # upper clip: ratio ceiling 1 + eps_clip_high (asymmetric, "clip-higher")
    dual_clip_c: float = 3.0      # for A < 0 the per-token loss is capped at -c * A (> 1 required)

    def __post_init__(self):
        assert 0 < self.eps_clip < 1 and self.eps_clip_high > 0, "clip ranges must be positive"
        assert self.dual_clip_c > 1, "dual_clip_c must exceed 1"


@dataclass
class LossOutput:
    loss: torch.Tensor          # scalar to backpropagate (masked token mean of the pg loss)
    num_tokens: int             # response tokens of the batch
    means: LossDiagnostics      # what the loss measured, token means over the batch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over True positions; NaN/inf at masked-out positions cannot leak in."""
    zeros = torch.zeros_like(values)
    return torch.where(mask, values, zeros).sum() / mask.sum().clamp(min=1)


def truncated_is_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                         clip: float) -> torch.Tensor:
    """min(pi_old / pi_engine, clip) per token (1 off the mask): corrects for sampling with the
    engine's (possibly older, possibly numerically different) weights when pi_old is recomputed."""
    zeros = torch.zeros_like(old_logp)
    log_w = torch.where(mask, old_logp - engine_logp, zeros)
    return torch.exp(torch.clamp(log_w, max=math.log(clip))).detach()


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, cfg: LossConfig = LossConfig(),
             engine_logp: torch.Tensor | None = None,
             is_weights: torch.Tensor | None = None,
             ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
             num_step_tokens: int | None = None, entropy: torch.Tensor | None = None) -> LossOutput:
    """Dual-clip PPO over (B, T) token tensors; `mask` is True on response tokens.

    rho = exp(clamp(where(mask, logp, old) - old, -20, 20))
    pg  = max(-rho * A, -clamp(rho, 1 - eps, 1 + eps_high) * A), and for A < 0 min(pg, -c * A).
    `old_logp` is the behaviour policy: the engine's logprobs, or the trainer's recomputed ones with
    `is_weights` (truncated importance sampling) correcting towards the engine's. `engine_logp`
    defaults to `old_logp` and only feeds the parity diagnostic.

    The loss is a token mean over the whole step: the per-token losses are summed and divided by
    `num_step_tokens`, the step's response tokens (default: this batch's). So micro-batches of one
    step, each divided by the step's count, add up to exactly the gradient of the whole batch; a mean of
    micro-batch means would weigh a short micro-batch's tokens more.

    With `ref_logp` (the reference policy's logprobs) the k3 estimate of KL(pi_theta || pi_ref),
    exp(ref - logp) - (ref - logp) - 1 per token (unbiased, never negative), is reported and, times
    `kl_coef`, added to the loss. `entropy` (per token, from `grpo.token_scores`) is only averaged
    into the diagnostics.
    """
    mask = mask.bool()
    zeros = torch.zeros_like(old_logp)
    old = torch.where(mask, old_logp, zeros)
    adv = torch.where(mask, advantages, zeros)
    # On masked positions the log-ratio is exactly 0, so no value there can overflow exp().
    log_ratio = torch.clamp(torch.where(mask, logp, old) - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip_high) * adv
    pg = torch.maximum(unclipped, clipped)
    dual_cap = -cfg.dual_clip_c * adv
    is_dual = (adv < 0) & (pg > dual_cap)
    pg = torch.where(adv < 0, torch.minimum(pg, dual_cap), pg)
    if is_weights is not None:
        pg = pg * torch.where(mask, is_weights, torch.ones_like(is_weights))
    denominator = num_step_tokens if num_step_tokens is not None else max(1, int(mask.sum()))
    loss = torch.where(mask, pg, zeros).sum() / denominator
    kl = None
    if ref_logp is not None:
        log_r = torch.clamp(torch.where(mask, ref_logp - logp, zeros), -20.0, 20.0)
        k3 = torch.where(mask, torch.exp(log_r) - log_r - 1, zeros)
        if kl_coef > 0:
            loss = loss + kl_coef * k3.sum() / denominator
        kl = float(masked_mean(k3.detach(), mask))
    with torch.no_grad():
        reference = old if engine_logp is None else torch.where(mask, engine_logp, zeros)
        clip_frac = masked_mean((clipped > unclipped).float(), mask)
        dual_frac = masked_mean(is_dual.float(), mask)
        parity = masked_mean((torch.where(mask, logp, reference) - reference).abs(), mask)
        mean_entropy = None if entropy is None else float(masked_mean(entropy.detach(), mask))
    means = LossDiagnostics(clip_fraction=float(clip_frac), dual_clip_fraction=float(dual_frac),
                            parity=float(parity), entropy=mean_entropy, kl=kl)
    return LossOutput(loss=loss, num_tokens=int(mask.sum()), means=means)
