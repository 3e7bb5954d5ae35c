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

from nano_miles.algo.advantages import has_signal


def diagnostic(help: str, *, prom: str | None = None, scale: float = 1.0, line=None, reduce=None, default=MISSING,
               default_factory=MISSING):
    """A diagnostic field. `prom`: its gauge's name (None: not exported); `line`: a format with one
    {} for the value, or a function value -> text or None (the step line leaves out None values);
    `reduce`: how batches combine (e.g. max), instead of a token-weighted mean."""
    return field(default=default, default_factory=default_factory,
                 metadata={"help": help, "prom": prom, "scale": scale, "line": line, "reduce": reduce})


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
    """What the policy loss measures, as token means over the response tokens it saw (`ratio_max`: the max)."""

    clip_fraction: float = diagnostic("Share of response tokens where the clipped term was taken, last step",
                                      prom="nanomiles_clip_fraction", line="clip {:.3f}", default=0.0)
    clip_low_fraction: float | None = diagnostic("Share of response tokens clipped at the ratio floor 1 - eps_clip "
                                                 "(A < 0), last step", prom="nanomiles_clip_low_ratio",
                                                 default=None)
    clip_high_fraction: float | None = diagnostic("Share of response tokens clipped at the ratio ceiling "
                                                  "1 + eps_clip_high (A > 0; cispo: weights truncated), last step",
                                                  prom="nanomiles_clip_high_ratio", default=None)
    dual_clip_fraction: float = diagnostic("Share of response tokens capped by the dual clip, last step", default=0.0)
    ratio_mean: float | None = diagnostic("Mean importance ratio pi_theta / pi_old per response token, last step",
                                          prom="nanomiles_importance_ratio_mean", default=None)
    ratio_max: float | None = diagnostic("Largest importance ratio of a response token, last step",
                                         prom="nanomiles_importance_ratio_max", reduce=max, default=None)
    parity: float = diagnostic("Mean |log pi_trainer - log pi_engine| per response token before the step",
                               prom="nanomiles_logprob_parity", line="parity {:.1e}", default=0.0)
    entropy: float | None = diagnostic("Mean policy entropy per response token (nats), last step",
                                       prom="nanomiles_entropy_mean", line="ent {:.3f}", default=None)
    kl: float | None = diagnostic("Mean KL estimate to the starting policy per response token, last step "
                                  "(trainer.kl_coef > 0)", prom="nanomiles_kl_mean", line="kl {:.4f}", default=None)

    @classmethod
    def token_mean(cls, parts: list[tuple[LossDiagnostics, int]]) -> LossDiagnostics:
        """The means over several batches of (diagnostics, response tokens): each field weighted by
        its batch's tokens, or reduced by its own `reduce` (e.g. max); a field no batch measured stays None."""
        total = max(1, sum(n for _, n in parts))
        means = {}
        for f in dataclasses.fields(cls):
            measured = [(getattr(d, f.name), n) for d, n in parts if getattr(d, f.name) is not None]
            if not measured:
                means[f.name] = None
            elif f.metadata.get("reduce"):
                means[f.name] = f.metadata["reduce"](v for v, _ in measured)
            else:
                means[f.name] = sum(v * n for v, n in measured) / total
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
    num_optimizer_steps: int = diagnostic("Optimizer steps the last step took (num_iterations x mini_batches, "
                                          "less the skipped)", line=lambda n: f"opt-steps {n}" if n != 1 else None,
                                          default=1)
    num_skipped_steps: int = diagnostic("Optimizer steps of the last step skipped for a gradient norm that was "
                                        "not finite", line=lambda n: f"SKIPPED {n}" if n else None, default=0)
    dropped_samples: dict = diagnostic("Samples of the last step that trained no token, by reason (truncated, "
                                       "nonfinite_logprob, impossible_logprob)",
                                       line=lambda d: f"untrained {d}" if d else None, default_factory=dict)
    kl_old: list = diagnostic("KL(pi_old || pi) per response token after each pass (num_iterations > 1)",
                              line=lambda v: f"kl-old {v[-1]:.2e}" if v else None, default_factory=list)
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
    response_length_mean: float = diagnostic("Mean response length of the last batch (tokens)",
                                             prom="nanomiles_response_length_mean", line="len {:.1f}", default=0.0)
    response_length_min: int = diagnostic("Shortest response of the last batch (tokens)", default=0)
    response_length_max: int = diagnostic("Longest response of the last batch (tokens)", default=0)
    truncated_fraction: float = diagnostic("Share of the last batch's responses cut at max_new_tokens",
                                           prom="nanomiles_truncated_ratio", line=share("trunc"), default=0.0)
    zero_std_fraction: float = diagnostic("Share of the last batch's groups whose rewards are all equal (no signal)",
                                          prom="nanomiles_zero_std_groups_ratio", line=share("zero-std"),
                                          default=0.0)
    advantage_mean: float = diagnostic("Mean advantage of the last batch's samples", default=0.0)
    advantage_std: float = diagnostic("Std of the last batch's advantages", prom="nanomiles_advantage_std",
                                      default=0.0)

    @classmethod
    def from_groups(cls, groups, step: int, learned, advantages) -> "StepStats":
        """The step's statistics from its groups (`wire.data.ScoredGroup`s), what the optimizer steps did and
        the samples' advantages (in the groups' order)."""
        rewards = np.concatenate([g.rewards for g in groups])
        names = sorted({k for g in groups for k in g.reward_parts})
        parts = {k: float(np.concatenate([g.reward_parts.get(k, np.zeros(len(g.rewards))) for g in groups]).mean())
                 for k in names}
        samples = [s for g in groups for s in g.group.samples]
        oldest = np.array([s.oldest_version for s in samples])
        lengths = np.array([len(s.response_tokens) for s in samples])
        staleness = (step - 1) - oldest
        values, counts = np.unique(staleness, return_counts=True)
        return cls(reward=float(rewards.mean()), format=parts.pop("format", None),
                   accuracy=parts.pop("accuracy", None), reward_parts=parts, learned=learned,
                   staleness_min=int(staleness.min()), staleness_max=int(staleness.max()),
                   staleness_mean=float(staleness.mean()),
                   staleness_hist={str(int(v)): int(c) for v, c in zip(values, counts)},
                   version_oldest=int(oldest.min()), num_samples=len(rewards),
                   response_length_mean=float(lengths.mean()), response_length_min=int(lengths.min()),
                   response_length_max=int(lengths.max()),
                   truncated_fraction=float(np.mean([s.finish_reason == "length" for s in samples])),
                   zero_std_fraction=float(np.mean([not has_signal(g.rewards) for g in groups])),
                   advantage_mean=float(np.mean(advantages)), advantage_std=float(np.std(advantages)))

    def as_dict(self) -> dict:
        return flatten(self)
