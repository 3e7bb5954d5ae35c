"""The formats the small policy is taught and measured in: a prompt layout, a response and how it ends.
Used as a library by the warm-up (`build.py`) and the evaluation (`evaluate.py`).

    raw   `What is (7 * 4) + 12? Put the answer in <answer></answer>.\\n` -> `7*4=28, 28+12=40 <answer>40</answer>` EOS
    chat  the same prompt as a ChatML user turn -> the same response, then `<|im_end|>`
    word  a word problem (`nano_miles.tasks.word_problems`) as a user turn -> `7*4=28, 28+12=40\\n#### 40<|im_end|>`
    tool  the word problem after a system turn that offers the calculator -> `<tool_call>(7*4)+12</tool_call><|im_end|>`,
          the tool's turn `40` (read, not taught), then `#### 40<|im_end|>`: two turns, the rollout
          `nano_miles.rollouts.tools` runs

`raw` is the default run (`nano_miles.tasks.arithmetic`), `chat` the same run with
`task.chat_template = true`, `word` a user-style run on a GSM8K-style file with the math reward,
`tool` that run with `task.system_prompt = TOOL_SYSTEM_PROMPT` and the calculator tool's rollout.
Prompts become ids the pipeline's way (`nano_miles/tasks/prompts.py`): no BOS, the chat template
when the format has it.
"""

from __future__ import annotations

import random

from nano_miles.rewards import math as math_reward
from nano_miles.rollouts.tools import CALL_CLOSE, CALL_OPEN
from nano_miles.tasks import Problem, arithmetic
from nano_miles.tasks.prompts import prompt_ids
from nano_miles.tasks.word_problems import solution, story, story_expressions
from nano_miles.policy.tokenizer import EOS, IM_END

# name -> (uses the chat template, the token that ends a response)
FORMATS = {"raw": (False, EOS), "chat": (True, IM_END), "word": (True, IM_END), "tool": (True, IM_END)}
TOOL_SYSTEM_PROMPT = "You have a calculator."  # short: a word problem and its two turns fit 256 positions


def encode_prompt(tokenizer, problem: Problem, *, chat_template: bool = False) -> list[int]:
    """The prompt's token ids as the pipeline sends them: no BOS; the chat template if asked for."""
    return prompt_ids(tokenizer, problem.prompt, chat_template=chat_template)


def format_problem(fmt: str, e) -> tuple[Problem, str | list]:
    """An arithmetic expression as a problem of format `fmt`, and the response the warm-up teaches:
    text, or for `tool` the turns [(text, is the model's)] (the tool's turn is its result alone)."""
    if fmt == "word":
        return Problem(story(e), solution(e)), solution(e)
    if fmt == "tool":
        prompt = ({"role": "system", "content": TOOL_SYSTEM_PROMPT}, {"role": "user", "content": story(e)})
        return Problem(prompt, solution(e)), [(f"{CALL_OPEN}{e.text().replace(' ', '')}{CALL_CLOSE}", True),
                                              (str(e.value()), False), (f"#### {e.value()}", True)]
    return Problem(arithmetic.render_prompt(e.text()), str(e.value())), e.worked_response()


def tag_first_step(response: str, e) -> str:
    """`response` (any format's) with its final answer, the last occurrence of the value, replaced by
    the first step's result: `7*4=28, 28+12=40 <answer>28</answer>`."""
    head, value, tail = response.rpartition(str(e.value()))
    assert value, f"{response!r} does not end with its answer {e.value()}"
    return head + str(e.inner_value()) + tail


def format_reward(fmt: str):
    """The reward function a run in this format uses."""
    return math_reward.reward if fmt in ("word", "tool") else arithmetic.reward


def format_expressions(fmt: str, split: str, seed: int = 0, num: int | None = None) -> list:
    """The expressions of `split` that `fmt` can tell (word problems: those that make a story), in a
    seeded order; for raw and chat the same order as `arithmetic.make_expressions`."""
    pool = list(story_expressions(split) if fmt in ("word", "tool") else arithmetic.split_expressions(split))
    random.Random(seed).shuffle(pool)
    return pool if num is None else pool[:num]


def format_problems(fmt: str, split: str, num: int, seed: int = 0) -> list[Problem]:
    return [format_problem(fmt, e)[0] for e in format_expressions(fmt, split, seed, num)]
