"""The engine as a rollout function sees it: token ids in, `Generation`s out, pauses never seen.
Used as a library: the rollout producer and the trainer's held-out evaluation build one per group and
hand it to the rollout function (`nano_miles/rollouts/__init__.py`). Test: `pytest tests/test_rollouts.py`.

`RolloutEngine.generate` hides what the server answers (SGLang's and the local engine's /generate
response: `output_ids`, `meta_info.output_token_logprobs`, `finish_reason`, `weight_version(s)`) and
the weight updates that happen while it waits: a request cut by an abort-mode pause comes back
partial, and is resumed from `prompt + its tokens so far` with the rest of its budget, as often as it
takes. Each segment keeps the log-probs and versions of the weights that produced it, and nothing is
re-tokenized at the seam, so the caller gets one `Generation` per prompt, token for token what the
engine produced, with the version of every token.

Seeds. A request's draws are a pure function of what it is: the group (run seed, group id, attempt,
through `seed_of`), which of its samples it continues, and how many requests that sample has made
before (a resumed segment or a later turn draws afresh; the same group on the same weights draws the
same, whichever other requests share the engine's batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nano_miles.engine.client import EngineError, parse_output, token_versions

MAX_SEGMENTS_PER_REQUEST = 64  # a request aborted this often means the engine is stuck in a pause loop


@dataclass
class Generation:
    """What the model wrote for one prompt: one turn, however many pauses it lived through."""

    tokens: list[int]      # token ids as generated (a stop token included when one ended it)
    logprobs: list[float]  # the sampling policy's log-prob of each token
    versions: list[int]    # the weight version that generated each token (>= 0)
    finish_reason: str     # "stop": a stop token ended it; "length": it used its whole budget


class RolloutEngine:
    """One group's handle on the engine: `generate` many prompts at once (the engine batches them).

    `send(input_ids, params)` is one /generate call (the producer's retries with backoff, or a client's
    `generate`); `sampling` the sampling parameters every request shares (temperature, top_p, top_k);
    `seed_of(sample, n)` the seed of sample `sample`'s n-th request; `on_resumed(num)` hears how many
    requests an abort-mode pause cut and this resumed."""

    def __init__(self, send: Callable, *, group_size: int, max_new_tokens: int, sampling: dict,
                 stop_token_ids: list[int], seed_of: Callable[[int, int], int], tokenizer=None, max_turns: int = 1,
                 on_resumed: Callable[[int], None] | None = None):
        self.group_size = group_size          # trajectories the rollout function returns
        self.max_new_tokens = max_new_tokens  # budget of a trajectory after the prompt (every turn's tokens)
        self.max_turns = max_turns            # the model's turns a multi-turn rollout may take (rollout.max_turns)
        self.tokenizer = tokenizer            # the model's, for rendering the next turn (`next_turn`)
        self._send, self._sampling, self._stops = send, dict(sampling), list(stop_token_ids)
        self._seed_of, self._on_resumed = seed_of, on_resumed
        self._num_requests = [0] * group_size

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int | list[int] | None = None,
                 samples: list[int] | None = None) -> list[Generation]:
        """One `Generation` per prompt, in order. `max_new_tokens`: the budget of each (default: the
        trajectory's, `self.max_new_tokens`); `samples[j]`: which of the group's samples prompt j
        continues (default j), which seeds its draws."""
        samples = list(range(len(prompts))) if samples is None else list(samples)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        budgets = list(budget) if isinstance(budget, list) else [budget] * len(prompts)
        if not (len(samples) == len(budgets) == len(prompts)) or not prompts:
            raise ValueError(f"generate: {len(prompts)} prompts, {len(samples)} sample indices, {len(budgets)} budgets")
        if min(budgets) < 1 or not all(0 <= i < self.group_size for i in samples):
            raise ValueError(f"generate: budgets must be >= 1 and samples in [0, {self.group_size}): "
                             f"{budgets}, {samples}")
        out = [Generation([], [], [], "") for _ in prompts]
        pending = list(range(len(prompts)))
        for _ in range(MAX_SEGMENTS_PER_REQUEST):
            params = [{"max_new_tokens": budgets[j] - len(out[j].tokens), **self._sampling,
                       "stop_token_ids": self._stops, "sampling_seed": self._next_seed(samples[j])} for j in pending]
            answers = self._send([prompts[j] + out[j].tokens for j in pending], params)
            still_pending = []
            for j, answer in zip(pending, answers):
                tokens, logprobs, reason, _ = parse_output(answer["meta_info"], answer["output_ids"])
                gen = out[j]
                gen.tokens += tokens
                gen.logprobs += logprobs
                gen.versions += token_versions(answer["meta_info"], len(tokens))
                if reason == "abort" and len(gen.tokens) < budgets[j]:
                    still_pending.append(j)  # cut by a pause: resumed where it stopped
                else:
                    gen.finish_reason = "length" if reason == "abort" else reason
            if still_pending and self._on_resumed is not None:
                self._on_resumed(len(still_pending))
            pending = still_pending
            if not pending:
                return out
        raise EngineError(0, f"requests were aborted {MAX_SEGMENTS_PER_REQUEST} times in a row")

    def next_turn(self, role: str, content: str) -> list[int]:
        """The ids that open the model's next turn after `content` from `role` (a tool's result, a
        user's reply), through the chat template (`nano_miles.tasks.prompts.turn_ids`)."""
        from nano_miles.tasks.prompts import turn_ids
        return turn_ids(self.tokenizer, {"role": role, "content": content})

    def decode(self, ids) -> str:
        """Text of token ids, special tokens dropped (what a tool reads of the model's turn)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def _next_seed(self, sample: int) -> int:
        n = self._num_requests[sample]
        self._num_requests[sample] += 1
        return self._seed_of(sample, n)
