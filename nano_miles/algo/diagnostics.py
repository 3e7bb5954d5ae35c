"""A step's training diagnostics, each declared once: a dataclass field whose metadata says how it is shown.

Library module. What the loss measures is a field of `LossDiagnostics` (token means over a batch),
what an optimizer step did one of `LearnResult`, what the step's batch held one of `StepStats`
(which `observe.run_record.StepRecord` writes to metrics.jsonl); a field that holds another of these dataclasses is spliced in
(`flatten`). A field's name is its key in metrics.jsonl (and in TensorBoard / W&B); `prom` names the
Prometheus gauge the trainer sets to the last step's value (times `scale`); `line` is how the
trainer's step line shows it. So adding a diagnostic is one edit: its field, and the code that
measures it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass, field

import numpy as np


def diagnostic(help: str, *, prom: str | None = None, scale: float = 1.0, line=None, default=MISSING,
               default_factory=MISSING):
    """A diagnostic field. `prom`: its gauge's name (None: not exported); `line`: a format with one
    {} for the value, or a function value -> text or None (the step line leaves out None values)."""
    return field(default=default, default_factory=default_factory,
                 metadata={"help": help, "prom": prom, "scale": scale, "line": line})


def declared(cls) -> list[dataclasses.Field]:
    """The diagnostic fields of `cls` in declaration order, those of nested diagnostic classes spliced in."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += declared(hints[f.name])
        elif "help" in f.metadata:
            out.append(f)
    return out


def flatten(obj) -> dict:
    """The fields of a diagnostics dataclass by name, nested ones spliced in (what metrics.jsonl keeps)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out.update(flatten(value) if dataclasses.is_dataclass(value) else {f.name: value})
    return out


def shown(f: dataclasses.Field, value) -> str | None:
    """The step line's text for one field's value, or None."""
    line = f.metadata.get("line")
    if line is None or value is None:
        return None
    return line(value) if callable(line) else line.format(value)


@dataclass
class LossDiagnostics:
    """What the policy loss measures, as token means over the response tokens it saw."""

    clip_fraction: float = diagnostic("Share of response tokens where the clipped term was taken, last step",
                                      prom="nanomiles_clip_fraction", line="clip {:.3f}")
    dual_clip_fraction: float = diagnostic("Share of response tokens capped by the dual clip, last step")
    parity: float = diagnostic("Mean |log pi_trainer - log pi_engine| per response token before the step",
                               prom="nanomiles_logprob_parity", line="parity {:.1e}")
    entropy: float | None = diagnostic("Mean policy entropy per response token (nats), last step",
                                       prom="nanomiles_entropy_mean", line="ent {:.3f}", default=None)
    kl: float | None = diagnostic("Mean k3 KL to the starting policy per response token, last step "
                                  "(trainer.kl_coef > 0)", prom="nanomiles_kl_mean", line="kl {:.4f}", default=None)

    @classmethod
    def token_mean(cls, parts: list[tuple[LossDiagnostics, int]]) -> LossDiagnostics:
        """The means over several batches of (diagnostics, response tokens): each field weighted by
        its batch's tokens; a field no batch measured stays None."""
        total = max(1, sum(n for _, n in parts))
        means = {}
        for f in dataclasses.fields(cls):
            measured = [(getattr(d, f.name), n) for d, n in parts if getattr(d, f.name) is not None]
            means[f.name] = sum(v * n for v, n in measured) / total if measured else None
        return cls(**means)


@dataclass
class LearnResult:
    """What one optimizer step did: the loss's diagnostics (token means over the step) and its costs."""

    pg_loss: float = diagnostic("Policy-gradient loss of the last step", prom="nanomiles_pg_loss", line="pg {:+.4f}")
    means: LossDiagnostics = field(default_factory=LossDiagnostics)
    grad_norm: float = diagnostic("Gradient norm before clipping, last step", prom="nanomiles_grad_norm",
                                  line="gnorm {:.3f}", default=0.0)
    lr: float = diagnostic("Learning rate of the last step", prom="nanomiles_learning_rate", line="lr {:.1e}",
                           default=0.0)
    num_tokens: int = diagnostic("Response tokens trained in the last step", default=0)
    num_micro_batches: int = diagnostic("Micro-batches of the last step", prom="nanomiles_micro_batches",
                                        line=lambda n: f"micro-batches {n}" if n > 1 else None, default=1)
    peak_memory_mb: float = diagnostic("CUDA max allocated in the last step, or the process's peak RSS on CPU",
                                       prom="nanomiles_peak_memory_bytes", scale=2**20, default=0.0)
    train_tokens_per_s: float = diagnostic("Prompt + response tokens through forward and backward per second, "
                                           "last step", prom="nanomiles_train_tokens_per_second", default=0.0)
    is_weight_mean: float | None = diagnostic("Mean truncated IS weight (recomputed pi_old only)", default=None)
    is_weight_max: float | None = diagnostic("Largest truncated IS weight (recomputed pi_old only)", default=None)
    is_weight_clipped: float | None = diagnostic("Share of IS weights at trainer.tis_clip (recomputed pi_old only)",
                                                 default=None)


def share(name: str):
    """A reward part's share on the step line, left out for a reward function without it."""
    return lambda value: f"{name} {value:6.1%}"


@dataclass
class StepStats:
    """A step's batch (rewards, staleness) and what training on it did (`learned`)."""

    reward: float = diagnostic("Mean reward of the last step's batch", prom="nanomiles_reward_mean",
                               line="reward {:.3f}")
    format: float | None = diagnostic("Share of well-formed answers in the last batch (reward part)",
                                      line=share("format"))
    accuracy: float | None = diagnostic("Share of correct samples in the last batch", prom="nanomiles_accuracy_ratio",
                                        line=share("acc"))
    learned: LearnResult = field(default_factory=lambda: LearnResult(pg_loss=0.0))
    update_ms: float = diagnostic("Weight update of the last step (push + telling the producer), ms",
                                  line="update {:.0f}ms", default=0.0)
    staleness_min: int = diagnostic("Least staleness of a trained sample, last step", default=0)
    staleness_max: int = diagnostic("Most staleness of a trained sample, last step", default=0)
    staleness_mean: float = diagnostic("Mean staleness of the trained samples, last step", default=0.0)
    staleness_hist: dict = diagnostic("Staleness -> samples, last step", default_factory=dict)
    version_oldest: int = diagnostic("Oldest weight version a trained token came from", default=0)
    num_samples: int = diagnostic("Samples trained in the last step", default=0)
    reward_parts: dict = diagnostic("Mean of every other reward part (e.g. math/accuracy)", default_factory=dict)

    @classmethod
    def from_groups(cls, groups, step: int, learned) -> "StepStats":
        """The step's statistics from its groups (`wire.data.ScoredGroup`s) and what the optimizer step did."""
        rewards = np.concatenate([g.rewards for g in groups])
        names = sorted({k for g in groups for k in g.reward_parts})
        parts = {k: float(np.concatenate([g.reward_parts.get(k, np.zeros(len(g.rewards))) for g in groups]).mean())
                 for k in names}
        oldest = np.array([s.oldest_version for g in groups for s in g.group.samples])
        staleness = (step - 1) - oldest
        values, counts = np.unique(staleness, return_counts=True)
        return cls(reward=float(rewards.mean()), format=parts.pop("format", None),
                   accuracy=parts.pop("accuracy", None), reward_parts=parts, learned=learned,
                   staleness_min=int(staleness.min()), staleness_max=int(staleness.max()),
                   staleness_mean=float(staleness.mean()),
                   staleness_hist={str(int(v)): int(c) for v, c in zip(values, counts)},
                   version_oldest=int(oldest.min()), num_samples=len(rewards))

    def as_dict(self) -> dict:
        return flatten(self)
