"""DAPO's soft overlong punishment: a reward that falls linearly over the last tokens of the budget.

Add it to a task's reward: `reward.fns = ["nano_miles.tasks.arithmetic:reward",
"nano_miles.rewards.overlong:reward"]` (its part is logged as `overlong/reward`). Settings:
`reward.overlong_buffer` (the ramp's length in tokens, default 16) and `reward.overlong_penalty` (its
depth, default 1).

With L the response's tokens, M = rollout.max_new_tokens and B the buffer (Yu et al. 2025, DAPO, eq. 13):

    0                           L <= M - B
    -penalty (L - (M - B)) / B  M - B < L <= M

so a response that stops well inside the budget is not touched, and one cut at M costs the whole
penalty. Here the engine never returns more than M tokens, so the paper's third case (L > M: -1)
does not arise. The trainer's `trainer.mask_truncated` is the hard alternative: a cut response trains
no token at all.
"""

from __future__ import annotations


def reward(response: str, label: str, *, num_response_tokens: int, max_new_tokens: int, overlong_buffer: int,
           overlong_penalty: float) -> dict[str, float]:
    """The length penalty of one response (<= 0); the text and the label do not matter."""
    start = max_new_tokens - overlong_buffer
    over = min(max(num_response_tokens - start, 0), overlong_buffer)
    return {"reward": -overlong_penalty * over / overlong_buffer}
