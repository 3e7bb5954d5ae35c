"""Held-out evaluation: greedy accuracy of the served weights on the task's test split.

Library module used by the trainer, which evaluates through the engine (the weights it just pushed).
"""

from __future__ import annotations

from nano_miles.run.config import Config
from nano_miles.tasks import encode_prompts, make_decoder


def make_evaluator(cfg: Config, problems, tokenizer, reward_fn):
    """A function engine -> greedy accuracy on the held-out `problems`, in one batched /generate call."""
    prompts = encode_prompts(tokenizer, problems)
    decode = make_decoder(tokenizer)
    params = {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": 0.0}

    def evaluate(engine) -> float:
        outputs = engine.generate(prompts, params, return_logprob=False)
        correct = [reward_fn(decode(out["output_ids"]), p.answer)["accuracy"]
                   for out, p in zip(outputs, problems)]
        return sum(correct) / len(correct)
    return evaluate
