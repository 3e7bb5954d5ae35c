"""Per-step statistics, the one-line step log, and the end-of-run summary.

Library module used by the trainer; `metrics.jsonl` in the run directory holds one record per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from nano_miles.ledger import group_id_at, position_of


@dataclass
class StepStats:
    reward: float
    format: float             # share of samples with a well-formed answer
    accuracy: float           # share of samples with the right answer
    pg_loss: float
    clip_fraction: float
    grad_norm: float
    parity: float             # mean |log pi_trainer - log pi_engine| on response tokens, before the step
    staleness_min: int
    staleness_max: int
    staleness_mean: float
    staleness_hist: dict          # staleness -> number of samples
    version_oldest: int           # oldest weight version a trained token came from
    num_samples: int
    num_tokens: int           # response tokens trained
    update_ms: float = 0.0
    is_weight_mean: float | None = None     # truncated IS weights (only with recomputed pi_old)
    is_weight_max: float | None = None
    is_weight_clipped: float | None = None

    @classmethod
    def from_groups(cls, groups, step: int, loss_out, grad_norm: float) -> "StepStats":
        rewards = np.concatenate([g.rewards for g in groups])
        parts = {k: np.concatenate([g.reward_parts.get(k, np.zeros(len(g.rewards))) for g in groups])
                 for k in ("format", "accuracy")}
        oldest = np.array([int(s.versions[0]) for g in groups for s in g.group.samples])
        staleness = (step - 1) - oldest
        values, counts = np.unique(staleness, return_counts=True)
        return cls(reward=float(rewards.mean()), format=float(parts["format"].mean()),
                   accuracy=float(parts["accuracy"].mean()), pg_loss=float(loss_out.loss.detach()),
                   clip_fraction=loss_out.clip_fraction, grad_norm=grad_norm, parity=loss_out.parity,
                   staleness_min=int(staleness.min()), staleness_max=int(staleness.max()),
                   staleness_mean=float(staleness.mean()),
                   staleness_hist={str(int(v)): int(c) for v, c in zip(values, counts)},
                   version_oldest=int(oldest.min()),
                   num_samples=len(rewards), num_tokens=loss_out.num_tokens)

    def as_dict(self) -> dict:
        return asdict(self)


def format_step_line(r: dict, num_steps: int) -> str:
    line = (f"step {r['step']:>4}/{num_steps} | reward {r['reward']:.3f} | format {100 * r['format']:5.1f}% "
            f"| acc {100 * r['accuracy']:5.1f}% | pg {r['pg_loss']:+.4f} | clip {r['clip_fraction']:.3f} "
            f"| gnorm {r['grad_norm']:.3f} | parity {r['parity']:.1e} | update {r['update_ms']:.0f}ms "
            f"| stale {r['staleness_max']} (v{r['version_oldest']} -> v{r['step'] - 1}) "
            f"| queue {r.get('queue_depth', 0)} | step {r['step_s']:.2f}s")
    if "eval_accuracy" in r:
        line += f" | held-out {100 * r['eval_accuracy']:.1f}%"
    return line


def merge_hists(hists) -> dict:
    total: dict[str, int] = {}
    for h in hists:
        for k, v in h.items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def ledger_report(state, outstanding: list[str], num_items: int,
                  dropped_for_good: dict[str, str] | None = None) -> dict:
    """Every prompt of the run: trained once (at which step), or why not. `num_items` is the size of
    the train split, which maps ids to positions; `outstanding` are ids the producer still had out at
    the end; `dropped_for_good` are ids the producer gave up on, with the reason."""
    dropped_for_good = dropped_for_good or {}
    trained_at: dict[str, list[int]] = {}
    for step, ids in state.trained_by_step.items():
        for group_id in ids:
            trained_at.setdefault(group_id, []).append(step)
    unfinished = set(outstanding)
    num_prompts = max([state.cursor] + [position_of(g, num_items) + 1 for g in unfinished | set(dropped_for_good)])
    prompts = {}
    for position in range(num_prompts):
        group_id = group_id_at(position, num_items)
        steps = trained_at.get(group_id, [])
        if steps:
            prompts[group_id] = f"trained at step {steps[0]}" + (f" and again at {steps[1:]}" if steps[1:] else "")
        elif group_id in dropped_for_good:
            prompts[group_id] = f"dropped: {dropped_for_good[group_id]}"
        elif group_id in unfinished:
            prompts[group_id] = "dropped: still being generated when the run ended"
        else:
            prompts[group_id] = "lost"
    values = list(prompts.values())
    return {"num_prompts": num_prompts,
            "num_trained_once": sum(v.startswith("trained") and "again" not in v for v in values),
            "num_trained_twice": sum("again" in v for v in values),
            "num_unfinished": sum(v.startswith("dropped: still") for v in values),
            "num_dropped": sum(v.startswith("dropped") and not v.startswith("dropped: still") for v in values),
            "num_lost": values.count("lost"), "prompts": prompts}


def summarize(steps: list[dict], evals: list[list]) -> dict:
    """Early vs late mean reward, held-out accuracy at start / max / end, and the gains."""
    window = max(1, len(steps) // 5)
    early = float(np.mean([r["reward"] for r in steps[:window]])) if steps else float("nan")
    late = float(np.mean([r["reward"] for r in steps[-window:]])) if steps else float("nan")
    start_acc = evals[0][1] if evals else float("nan")
    max_acc = max(e[1] for e in evals) if evals else float("nan")
    return {
        "num_steps": len(steps),
        "reward_early": early, "reward_late": late, "reward_delta": late - early,
        "eval_accuracy_start": start_acc, "eval_accuracy_max": max_acc,
        "eval_accuracy_end": evals[-1][1] if evals else float("nan"),
        "eval_accuracy_delta": max_acc - start_acc,
        "staleness_max": max((r["staleness_max"] for r in steps), default=0),
        "staleness_hist": merge_hists(r["staleness_hist"] for r in steps),
        "goodput": steps[-1].get("goodput") if steps else None,
        "drops": steps[-1].get("drops", {}) if steps else {},
        "mean_step_s": float(np.mean([r["step_s"] for r in steps])) if steps else float("nan"),
        "mean_update_ms": float(np.mean([r["update_ms"] for r in steps])) if steps else float("nan"),
        "evals": evals,  # [step, held-out accuracy, seconds since training started]
    }
