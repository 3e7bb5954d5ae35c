"""The policy losses (`trainer.loss`), the KL estimators and the entropy bonus, with what a run should log.

Library module; the learner calls `policy_loss` once per micro-batch. `tests/test_loss.py` and
`tests/test_loss_variants.py` check every variant against plain-Python arithmetic.

All tensors are (B, T) over prediction positions; `mask` is True on response tokens, and nothing off
it (padding, prompt, a NaN an engine reported there) can reach the loss or its gradient. A loss is a
per-token term and an aggregation; every aggregation divides by the totals of the whole optimizer
step (`StepTotals`), so micro-batches of one step, each given the step's totals, add up to the whole
batch's loss and gradient.

    aggregation  divides the summed per-token terms by                  used by
    token        the step's response tokens                             dapo, cispo
    sequence     each sample's tokens, then the step's samples          grpo, gspo, gspo_token
    constant     samples x max_new_tokens (a constant, not the data's)  dr_grpo

Numerical safety: a log-ratio is clamped to [-20, 20] and a NaN one counts as 0 (ratio 1), so no
ratio, weight or KL term overflows and every gradient is finite, whatever log-prob an engine reports
(-inf, the most negative float, NaN). `unusable_logprobs` names such a sample so the trainer can
leave it out; the clamps keep the step finite when one slips through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from nano_miles.algo.diagnostics import LossDiagnostics

LOSSES = ("dapo", "grpo", "dr_grpo", "gspo", "gspo_token", "cispo")
KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_LOG_RATIO = 20.0    # exp(20) = 4.9e8: far past any clip, far below float32's overflow
LOGPROB_FLOOR = -1e4    # below this an engine is saying "probability 0", not measuring one
AGGREGATION = {"dapo": "token", "grpo": "sequence", "dr_grpo": "constant", "gspo": "sequence",
               "gspo_token": "sequence", "cispo": "token"}


@dataclass
class LossConfig:
    eps_clip: float = 0.2         # lower clip: ratio floor 1 - eps_clip
    eps_clip_high: float = 0.28   # upper clip: ratio ceiling 1 + eps_clip_high (asymmetric, "clip-higher")
    dual_clip_c: float = 3.0      # for A < 0 the per-token loss is capped at -c * A (> 1 required)
    name: str = "dapo"            # one of LOSSES
    max_new_tokens: int = 0       # dr_grpo's constant normalizer
    kl_coef: float = 0.0          # KL to the reference in the loss (0: none, or the learner puts it in the reward)
    kl_estimator: str = "k3"      # one of KL_ESTIMATORS
    entropy_coef: float = 0.0     # entropy bonus: the loss loses entropy_coef x the aggregated entropy

    def __post_init__(self):
        assert 0 < self.eps_clip < 1 and self.eps_clip_high > 0, "clip ranges must be positive"
        assert self.dual_clip_c > 1, "dual_clip_c must exceed 1"
        assert self.name in LOSSES, f"loss must be one of {LOSSES}, not {self.name!r}"
        assert self.kl_estimator in KL_ESTIMATORS, f"kl_estimator must be one of {KL_ESTIMATORS}"
        assert self.name != "dr_grpo" or self.max_new_tokens > 0, "dr_grpo divides by max_new_tokens > 0"


@dataclass
class StepTotals:
    """The normalizers of one optimizer step, summed over all its micro-batches."""
    num_tokens: int    # response tokens in the loss
    num_samples: int   # samples with at least one such token


# what `LossOutput.means` reads from the measured values, in the order `policy_loss` stacks them
_MEASURED = ("clip_fraction", "clip_low_fraction", "clip_high_fraction", "dual_clip_fraction", "ratio_mean",
             "ratio_max", "parity", "entropy", "kl")


class LossOutput:
    """A micro-batch's loss, and what it measured. The measurements stay on the loss's device, stacked,
    until `means` or `num_tokens` is first read: reading them waits for the device, so the learner reads
    them once per optimizer step, never between micro-batches."""

    def __init__(self, loss: torch.Tensor, measured: torch.Tensor, num_tokens: torch.Tensor,
                 has_entropy: bool, has_kl: bool):
        self.loss = loss                    # scalar to backpropagate
        self._measured = torch.cat([measured, num_tokens.reshape(1).to(measured.dtype)])
        self._has = {"entropy": has_entropy, "kl": has_kl}
        self._read: tuple[LossDiagnostics, int] | None = None

    def _host(self) -> tuple[LossDiagnostics, int]:
        if self._read is None:
            *values, num_tokens = self._measured.tolist()
            means = dict(zip(_MEASURED, values))
            for name, has in self._has.items():
                means[name] = means[name] if has else None
            if num_tokens == 0:  # no response token: no ratio to take the max of
                means["ratio_max"] = None
            self._read = LossDiagnostics(**means), int(num_tokens)
        return self._read

    @property
    def means(self) -> LossDiagnostics:
        """What the loss measured, token means over the batch (ratio_max: the max)."""
        return self._host()[0]

    @property
    def num_tokens(self) -> int:
        """The batch's response tokens."""
        return self._host()[1]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over True positions; NaN/inf at masked-out positions cannot leak in."""
    zeros = torch.zeros_like(values)
    return torch.where(mask, values, zeros).sum() / mask.sum().clamp(min=1)


def safe_log_ratio(values: torch.Tensor) -> torch.Tensor:
    """A log-ratio that exp() can take: NaN -> 0, the rest clamped to +-MAX_LOG_RATIO (infinities too)."""
    return torch.clamp(torch.nan_to_num(values, nan=0.0), -MAX_LOG_RATIO, MAX_LOG_RATIO)


def unusable_logprobs(logprobs) -> str | None:
    """Why no loss should train on a sample with these engine log-probs (any 1-D array), or None: a NaN or
    infinity ("nonfinite_logprob"), or a value below LOGPROB_FLOOR ("impossible_logprob": the engine
    sampled a token it gives no probability, so its ratio says nothing)."""
    values = np.asarray(logprobs, dtype=np.float64)  # the wire's read-only arrays as they are, no copy to torch
    if not np.isfinite(values).all():
        return "nonfinite_logprob"
    if values.size and values.min() < LOGPROB_FLOOR:
        return "impossible_logprob"
    return None


def truncated_is_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                         clip: float) -> torch.Tensor:
    """min(pi_old / pi_engine, clip) per token (1 off the mask): corrects for sampling with the
    engine's (possibly older, possibly numerically different) weights when pi_old is recomputed."""
    zeros = torch.zeros_like(old_logp)
    log_w = torch.nan_to_num(torch.where(mask, old_logp - engine_logp, zeros), nan=0.0)
    return torch.exp(torch.clamp(log_w, max=math.log(clip))).detach()


def kl_terms(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimates of KL(pi || pi_ref) on tokens sampled from pi (Schulman, "Approximating KL
    divergence", 2020), 0 off the mask; with r = pi_ref / pi:

        k1 = -log r             unbiased, can be negative; as a loss it only pushes sampled tokens
                                down, which is toward the reference where the policy rose above it
        k2 = (log r)^2 / 2      biased, never negative; its gradient pulls log pi toward log pi_ref
        k3 = r - 1 - log r      unbiased, never negative (the default; also GRPO's)

    log r is clamped to +-MAX_LOG_RATIO first, so a token the reference finds all but impossible costs at
    most 20 nats (k1), not an overflow."""
    zeros = torch.zeros_like(logp)
    log_r = safe_log_ratio(torch.where(mask, ref_logp - logp, zeros))
    if estimator == "k1":
        terms = -log_r
    elif estimator == "k2":
        terms = 0.5 * log_r * log_r
    elif estimator == "k3":
        terms = torch.exp(log_r) - log_r - 1
    else:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    return torch.where(mask, terms, zeros)


def aggregate(terms: torch.Tensor, mask: torch.Tensor, how: str, totals: StepTotals, max_new_tokens: int,
              coef: float = 1.0):
    """`coef` x the step's share of the summed per-token `terms` (see the module's table)."""
    summed = torch.where(mask, terms, torch.zeros_like(terms))
    if how == "token":  # (coef x sum) / tokens: the order this loss always took, to the bit
        return coef * summed.sum() / totals.num_tokens
    if how == "sequence":
        return coef * (summed.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / totals.num_samples
    return coef * summed.sum() / (totals.num_samples * max_new_tokens)


def ppo_terms(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig, dual: bool):
    """Clipped PPO per token: max(-rho A, -clip(rho, 1 - eps, 1 + eps_high) A), and with `dual` for A < 0
    at most -c A (Ye et al. 2020, dual-clip); (terms, clipped term taken, dual cap taken)."""
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - cfg.eps_clip, 1 + cfg.eps_clip_high) * adv
    pg = torch.maximum(unclipped, clipped)
    is_dual = torch.zeros_like(pg, dtype=torch.bool)
    if dual:
        dual_cap = -cfg.dual_clip_c * adv
        is_dual = (adv < 0) & (pg > dual_cap)
        pg = torch.where(adv < 0, torch.minimum(pg, dual_cap), pg)
    return pg, clipped > unclipped, is_dual


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: LossConfig = LossConfig(), totals: StepTotals | None = None, *,
                engine_logp: torch.Tensor | None = None, is_weights: torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> LossOutput:
    """The loss `cfg.name` of one micro-batch; `totals` None = this batch is the whole step.

    rho = pi_theta / pi_old per token; A the sample's advantage on each of its tokens.
      dapo        dual-clip PPO per token, token mean over the step (DAPO, Yu et al. 2025; TRL
                  loss_type "dapo", verl loss_agg_mode "token-mean"). The default.
      grpo        the same terms, averaged per sample, then over samples (Shao et al. 2024; TRL "grpo").
      dr_grpo     the same terms summed, over samples x max_new_tokens (Liu et al. 2025, Dr. GRPO; TRL
                  "dr_grpo"): no length normalization, so long wrong answers are not let off lightly.
      gspo        one ratio per sample, s = exp(mean_t log rho_t), clipped per sample, averaged over
                  samples (Zheng et al. 2025, GSPO; TRL importance_sampling_level "sequence"); its clip
                  range is ~1e-3 wide (the paper's 3e-4 / 4e-4), not PPO's 0.2.
      gspo_token  s_t = sg[s] x pi_theta(y_t) / sg[pi_theta(y_t)]: the value of gspo's ratio, the
                  gradient of each token (GSPO-token); with one advantage per sample it equals gspo.
      cispo       -sg[min(rho, 1 + eps_high)] A log pi_theta per token, token mean (MiniMax-M1, 2025): the
                  weight is clipped, never the gradient, so no token drops out of the update; no lower
                  bound on the weight, as in the paper (a rare token's small ratio only shrinks its push).
    `old_logp` is the behaviour policy: the engine's log-probs, or the trainer's recomputed ones with
    `is_weights` (truncated importance sampling towards the engine's), which multiply every token's
    term. `engine_logp` (default `old_logp`) only feeds the parity diagnostic. With `ref_logp`,
    cfg.kl_coef x the aggregated KL estimate is added, and with `entropy` (per token)
    cfg.entropy_coef x its aggregate is subtracted; both are aggregated as the loss is.
    """
    mask = mask.bool()
    how = AGGREGATION[cfg.name]
    if totals is None:  # (reads the mask's counts: a wait for the device; the learner passes its totals)
        totals = StepTotals(max(1, int(mask.sum())), max(1, int(mask.any(dim=1).sum())))
    zeros = torch.zeros_like(old_logp)
    old = torch.where(mask, old_logp, zeros)
    adv = torch.where(mask, advantages, zeros)
    # On masked-out positions the log-ratio is exactly 0, so no value there can overflow exp().
    log_ratio = safe_log_ratio(torch.where(mask, logp, old) - old)
    dual, clip_taken = False, None
    if cfg.name in ("gspo", "gspo_token"):
        per_sample = (torch.where(mask, log_ratio, zeros).sum(dim=1) / mask.sum(dim=1).clamp(min=1))[:, None]
        log_ratio = per_sample if cfg.name == "gspo" else per_sample.detach() + (logp - logp.detach())
        log_ratio = torch.where(mask, log_ratio.expand_as(zeros), zeros)
    ratio = torch.exp(log_ratio)
    if cfg.name == "cispo":
        weight = torch.clamp(ratio, max=1 + cfg.eps_clip_high).detach()
        terms = -weight * adv * torch.where(mask, logp, zeros)
        is_low, is_high, is_dual = torch.zeros_like(mask), ratio > 1 + cfg.eps_clip_high, torch.zeros_like(mask)
    else:
        dual = cfg.name in ("dapo", "grpo", "dr_grpo")
        terms, clip_taken, is_dual = ppo_terms(ratio, adv, cfg, dual)
        is_low, is_high = clip_taken & (ratio < 1), clip_taken & (ratio > 1)
    if is_weights is not None:
        terms = terms * torch.where(mask, is_weights, torch.ones_like(is_weights))
    loss = aggregate(terms, mask, how, totals, cfg.max_new_tokens)
    kl = None
    if ref_logp is not None:
        k = kl_terms(logp, ref_logp, mask, cfg.kl_estimator)
        if cfg.kl_coef > 0:
            loss = loss + aggregate(k, mask, how, totals, cfg.max_new_tokens, cfg.kl_coef)
        kl = masked_mean(k.detach(), mask)
    if entropy is not None and cfg.entropy_coef > 0:
        loss = loss - aggregate(entropy, mask, how, totals, cfg.max_new_tokens, cfg.entropy_coef)
    with torch.no_grad():
        reference = old if engine_logp is None else torch.where(mask, engine_logp, zeros)
        gap = torch.nan_to_num((torch.where(mask, logp, reference) - reference).abs(), nan=0.0).clamp(max=1e6)
        seen = ratio.detach()
        none = torch.zeros((), dtype=zeros.dtype, device=zeros.device)
        measured = torch.stack([
            masked_mean((is_low | is_high).float(), mask), masked_mean(is_low.float(), mask),
            masked_mean(is_high.float(), mask), masked_mean(is_dual.float(), mask), masked_mean(seen, mask),
            torch.where(mask, seen, zeros).max(), masked_mean(gap, mask),
            none if entropy is None else masked_mean(entropy.detach(), mask), none if kl is None else kl])
    return LossOutput(loss, measured, mask.sum(), has_entropy=entropy is not None, has_kl=kl is not None)
