"""Held-out evaluation of the served weights: greedy accuracy and mean reward, and pass@k when asked.

Library module used by the trainer, which evaluates through the engine (the weights it just pushed),
with the run's prompt format (chat template included), rollout function (a multi-turn one calls its
tools here too) and reward function, which runs in a forked
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from nano_miles.engine.client import sampling_seed
from nano_miles.rewards import describe, response_text, scored_facts
from nano_miles.rewards.worker import FailureLimit, score_all
from nano_miles.rollouts import RolloutEngine, load_rollout, make_records, sample_group
from nano_miles.run.config import Config
from nano_miles.tasks import Problem
from nano_miles.tasks.prompts import encode_prompts, make_decoder

log = logging.getLogger("trainer")
MAX_EVAL_THREADS = 256  # problems in flight at once (the engine batches them)


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
    """A function (engine, step, elapsed_s) -> EvalResult on the held-out `problems`: every problem
    through the run's rollout function (`rollout.fn`) at once, so the engine batches them."""
    records = make_records(problems, encode_prompts(tokenizer, problems, cfg.task))
    rollout_fn = load_rollout(cfg.rollout)
    decode = make_decoder(tokenizer)
    r, k = cfg.rollout, cfg.trainer.eval_samples
    limit = FailureLimit(describe(cfg.reward), cfg.reward.max_failure_fraction)

    def rollouts(engine, step: int, num: int, temperature: float) -> list:
        """`num` samples of every problem, in order (`wire.data.Sample`s)."""
        def one(record):
            # pass@k draws: a function of (run seed, step, problem, sample), never of timing
            seed_of = lambda j, n: sampling_seed(cfg.run.seed, "eval", step, record.index, j, *([n] if n else []))  # noqa: E731
            sampling = {"temperature": temperature, "top_p": r.top_p, "top_k": r.top_k} if temperature else \
                {"temperature": 0.0}
            adapter = RolloutEngine(engine.generate, group_size=num, max_new_tokens=r.max_new_tokens,
                                    sampling=sampling, stop_token_ids=stop_ids, seed_of=seed_of, tokenizer=tokenizer,
                                    max_turns=r.max_turns)
            return sample_group(rollout_fn, record, adapter)
        with ThreadPoolExecutor(min(len(records), MAX_EVAL_THREADS), thread_name_prefix="eval") as pool:
            return [s for group in pool.map(one, records) for s in group]

    def scores(samples, of_problem: list[Problem]) -> list[dict[str, float]]:
        """The reward and parts of each sample, `of_problem[i]` the problem of sample i."""
        failures = []
        parts = score_all(worker, [(response_text(s, decode), p.answer,
                                    scored_facts(cfg, s, decode, p, takes_record=worker.takes_record))
                                   for s, p in zip(samples, of_problem)], lambda _, failure: failures.append(failure))
        if failures:
            log.warning("the reward function failed on %d of %d held-out samples (scored 0); the last: %s",
                        len(failures), len(parts), failures[-1])
        limit.check(len(parts), failures)
        return parts

    def evaluate(engine, step: int, elapsed_s: float) -> EvalResult:
        parts = scores(rollouts(engine, step, 1, 0.0), problems)
        has_accuracy = any("accuracy" in p for p in parts)
        accuracy = sum(p.get("accuracy", 0.0) for p in parts) / len(parts) if has_accuracy else None
        pass_at_k = None
        if k > 1:
            sampled = scores(rollouts(engine, step, k, r.temperature), [p for p in problems for _ in range(k)])
            pass_at_k = sum(any(is_solved(s) for s in sampled[i * k:(i + 1) * k])
                            for i in range(len(problems))) / len(problems)
        others = sorted({name for p in parts for name in p} - {"reward", "accuracy"})
        means = {name: sum(p.get(name, 0.0) for p in parts) / len(parts) for name in others}
        return EvalResult(step, elapsed_s, accuracy, sum(p["reward"] for p in parts) / len(parts), pass_at_k, k,
                          means)
    return evaluate
