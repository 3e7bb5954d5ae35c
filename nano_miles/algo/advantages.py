"""Advantage estimators: a step's rewards, group by group, in; one advantage per sample out.

Library module; the trainer's learner calls `estimate` once per step, over the groups it trains
(`trainer.advantage`, `trainer.scale_rewards`). `tests/test_advantages.py` checks each estimator
against a plain-Python computation.

Every estimator is a pure function of a list of 1-D reward tensors (one per group; groups may differ
in size) and returns a list of the same shapes in float32. The arithmetic is float64, so the spread
of tiny rewards survives. The zero-variance guard means the same for each: a group whose rewards are
all equal (std < ZERO_STD) carries no signal, and every sample of it gets exactly 0, not float noise
amplified by a small divisor. `has_signal` is that test, and the trainer's dynamic sampling
(`trainer.skip_zero_variance`) consumes such a group without training it.
"""

from __future__ import annotations

import numpy as np
import torch

ZERO_STD = 1e-7     # a group whose reward std is below this carries no signal: its advantages are 0
EPS = 1e-6          # added to a std before dividing by it
SCALES = ("group", "batch", "none")


def _std(x: torch.Tensor) -> torch.Tensor:
    return x.std(unbiased=False)  # population std: a 1-sample group has std 0, not NaN


def _float64(rewards) -> torch.Tensor:
    """A 1-D float64 copy (the wire's arrays are read-only views, which torch will not wrap)."""
    return torch.from_numpy(np.array(rewards, dtype=np.float64).reshape(-1))


def has_signal(rewards) -> bool:
    """Do a group's rewards differ? (std >= ZERO_STD; a single sample never does)"""
    return bool(_std(_float64(rewards)) >= ZERO_STD)


def _guarded(groups: list[torch.Tensor], advantages: list[torch.Tensor]) -> list[torch.Tensor]:
    """Exactly 0 for every group without signal."""
    return [torch.zeros_like(a) if _std(r) < ZERO_STD else a for r, a in zip(groups, advantages)]


def grpo(groups: list[torch.Tensor], scale: str = "group") -> list[torch.Tensor]:
    """GRPO's group-relative advantage, A_i = (R_i - mean_g) / s (Shao et al. 2024, DeepSeekMath).

    `scale` picks s, as TRL's `scale_rewards`: "group" s = std_g + EPS (population std of the group:
    GRPO as published, and this project's default); "batch" s = std of every reward of the step + EPS
    (more robust when a group's spread is tiny; TRL's "batch"); "none" s = 1 (Dr. GRPO, Liu et al.
    2025: dividing by the group's std over-weights groups that are almost all right or all wrong).
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if scale == "group":
        out = []
        for r in groups:  # as a (1, G) row, the arithmetic this project always used (bit for bit)
            row = r[None, :]
            mean, std = row.mean(dim=1, keepdim=True), row.std(dim=1, keepdim=True, unbiased=False)
            out.append(((row - mean) / (std + EPS))[0])
        return _guarded(groups, out)
    centered = [r - r.mean() for r in groups]
    if scale == "batch":
        batch_std = _std(torch.cat(groups)) + EPS
        centered = [c / batch_std for c in centered]
    return _guarded(groups, centered)


def rloo(groups: list[torch.Tensor], scale: str = "group") -> list[torch.Tensor]:
    """REINFORCE leave-one-out: A_i = R_i - mean of the group's other rewards = G/(G-1) (R_i - mean_g)
    (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"). Unbiased: a sample's baseline does not
    depend on its own reward. Not scaled (`scale` must be "group", the default). A 1-sample group has
    no baseline and gets 0."""
    out = []
    for r in groups:
        n = len(r)
        out.append((r - (r.sum() - r) / (n - 1)) if n > 1 else torch.zeros_like(r))
    return _guarded(groups, out)


def reinforce_pp(groups: list[torch.Tensor], scale: str = "group") -> list[torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025; OpenRLHF's "reinforce_baseline"): c_i = R_i - mean_g,
    then normalized over the whole step, A_i = (c_i - mean(c)) / (std(c) + EPS) with mean and std over
    every sample of the step. The global normalization keeps the step's scale stable without dividing
    a group by its own (possibly tiny) spread. Here per sample; OpenRLHF whitens per token, which
    weighs long responses more. `scale` must be "group" (the default)."""
    centered = [r - r.mean() for r in groups]
    flat = torch.cat(centered)
    mean, std = flat.mean(), _std(flat)
    return _guarded(groups, [(c - mean) / (std + EPS) for c in centered])


ESTIMATORS = {"grpo": grpo, "rloo": rloo, "reinforce_pp": reinforce_pp}


def estimate(name: str, rewards: list, scale: str = "group") -> list[torch.Tensor]:
    """Advantages by estimator `name` for a step's groups of rewards (any 1-D float arrays)."""
    if name not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {tuple(ESTIMATORS)}, got {name!r}")
    if name != "grpo" and scale != "group":
        raise ValueError(f"reward scaling {scale!r} is grpo's option; {name} takes no scale")
    if any(len(r) < 1 for r in rewards):
        raise ValueError("every group needs at least one reward")
    groups = [_float64(r) for r in rewards]
    return [a.to(torch.float32) for a in ESTIMATORS[name](groups, scale)]
