"""Held-out evaluation of the served weights: greedy accuracy and mean reward, and pass@k when asked.

Library module used by the trainer, which evaluates through the engine (the weights it just pushed),
with the run's prompt format (chat template included) and reward function, which runs in a forked
worker with the reward stage's per-sample timeout and failure limit: a held-out pass on which the
function fails throughout, or past `reward.max_failure_fraction`, stops the trainer as it stops the
reward stage.

Accuracy is the mean of the reward function's "accuracy" part; a function without one has no
accuracy (None), and its mean reward stands for it. With `trainer.eval_samples` = k > 1, k more
samples per problem at the rollout temperature give pass@k: the share of problems with at least
one solved sample (accuracy 1, or a positive reward for a function without accuracy). Every other
part the reward function reports is averaged over the greedy answers too (`EvalResult.parts`; the
arithmetic task's "first_step" is the share of answers that tag the first step's result).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from nano_miles.engine.client import sampling_seed
from nano_miles.rewards import describe, sample_facts
from nano_miles.rewards.worker import FailureLimit, score
from nano_miles.run.config import Config
from nano_miles.tasks.prompts import encode_prompts, make_decoder

log = logging.getLogger("trainer")


@dataclass
class EvalResult:
    """One held-out evaluation. `as_dict` is how the trainer's state, summary.json's "evals" and
    metrics.jsonl (each field as `eval_<name>`, each part as `eval_<part>`) keep it."""

    step: int
    elapsed_s: float         # wall time since the run started
    accuracy: float | None   # greedy, from the "accuracy" part; None if the reward function has none
    reward: float            # greedy mean reward
    pass_at_k: float | None  # with trainer.eval_samples = k > 1
    k: int
    parts: dict[str, float] = field(default_factory=dict)  # mean of every other reward part, e.g. first_step

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [] if self.accuracy is None else [f"accuracy {100 * self.accuracy:.1f}%"]
        parts.append(f"mean reward {self.reward:.3f}")
        if self.pass_at_k is not None:
            parts.append(f"pass@{self.k} {100 * self.pass_at_k:.1f}%")
        parts += [f"{name} {value:.3f}" for name, value in self.parts.items()]
        return ", ".join(parts)


def is_solved(parts: dict[str, float]) -> bool:
    return parts["accuracy"] >= 1.0 if "accuracy" in parts else parts["reward"] > 0


def make_evaluator(cfg: Config, problems, tokenizer, worker, stop_ids: list[int]):
    """A function (engine, step, elapsed_s) -> EvalResult on the held-out `problems`, in batched
    /generate calls."""
    prompts = encode_prompts(tokenizer, problems, cfg.task)
    decode = make_decoder(tokenizer)
    r, k = cfg.rollout, cfg.trainer.eval_samples
    greedy = {"max_new_tokens": r.max_new_tokens, "temperature": 0.0, "stop_token_ids": stop_ids}

    limit = FailureLimit(describe(cfg.reward), cfg.reward.max_failure_fraction)

    def scores(outputs, labels) -> list[dict[str, float]]:
        failures = []
        parts = [score(worker, decode(out["output_ids"]), label, failures.append,
                       sample_facts(cfg, len(out["output_ids"]), out["meta_info"]["finish_reason"]["type"]))
                 for out, label in zip(outputs, labels)]
        if failures:
            log.warning("the reward function failed on %d of %d held-out samples (scored 0); the last: %s",
                        len(failures), len(parts), failures[-1])
        limit.check(len(parts), failures)
        return parts

    def evaluate(engine, step: int, elapsed_s: float) -> EvalResult:
        labels = [p.answer for p in problems]
        parts = scores(engine.generate(prompts, greedy, return_logprob=False), labels)
        has_accuracy = any("accuracy" in p for p in parts)
        accuracy = sum(p.get("accuracy", 0.0) for p in parts) / len(parts) if has_accuracy else None
        pass_at_k = None
        if k > 1:
            params = [{"max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
                       "top_k": r.top_k, "stop_token_ids": stop_ids,
                       "sampling_seed": sampling_seed(cfg.run.seed, "eval", step, i, j)}
                      for i in range(len(prompts)) for j in range(k)]
            sampled = scores(engine.generate([p for p in prompts for _ in range(k)], params, return_logprob=False),
                             [label for label in labels for _ in range(k)])
            pass_at_k = sum(any(is_solved(s) for s in sampled[i * k:(i + 1) * k])
                            for i in range(len(prompts))) / len(prompts)
        others = sorted({name for p in parts for name in p} - {"reward", "accuracy"})
        means = {name: sum(p.get(name, 0.0) for p in parts) / len(parts) for name in others}
        return EvalResult(step, elapsed_s, accuracy, sum(p["reward"] for p in parts) / len(parts), pass_at_k, k,
                          means)
    return evaluate
