"""Two-step integer arithmetic: problems, the prompt, the worked response and the reward.
Used as a library: `make_problems("train", 1000)`; the task is `task.name = "nano_miles.tasks.arithmetic"`,
its reward plug-in `nano_miles.tasks.arithmetic:reward`.

A problem is one binary operation inside parentheses combined with one more number, e.g.
`(7 * 4) + 12` or `10 - (12 * 6)`, operands 1..MAX_OPERAND. The policy is taught to answer so:

    prompt:   What is (7 * 4) + 12? Put the answer in <answer></answer>.\n
    response: 7*4=28, 28+12=40 <answer>40</answer>

The worked step gives RL partial structure to improve on; only the tagged number is scored. The
reward also reports, as the part "first_step", whether the tag holds the response's first step result
instead of its last (`7*4=28, 28+12=40 <answer>28</answer>`): the habit the shipped policy's warm-up
taught on purpose (nano_miles/assets/policy/README.md), so a run shows how much of its gain is that
habit going away.
"""

import functools
import hashlib
import random
import re
from dataclasses import dataclass

from nano_miles.tasks import Problem

SPLITS = ("train", "test")
OPS = ("+", "-", "*")
MAX_OPERAND = 12  # 20 made the small policy's warm-up about twice as long for the same accuracy
# One test expression in TEST_ONE_IN goes to the test split, decided by a stable hash of its text.
TEST_ONE_IN = 10

PROMPT_TEMPLATE = "What is {expression}? Put the answer in <answer></answer>.\n"
OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"
INTEGER_RE = re.compile(r"-?[0-9]+")  # ASCII digits only: \d would also accept other scripts' digits
STEP_RESULT_RE = re.compile(r"=(-?[0-9]+)")


def apply_op(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


@dataclass(frozen=True)
class Expression:
    """`(a op_inner b) op_outer c` when is_left, else `c op_outer (a op_inner b)`."""

    a: int
    op_inner: str
    b: int
    op_outer: str
    c: int
    is_left: bool

    def text(self) -> str:
        inner = f"({self.a} {self.op_inner} {self.b})"
        return f"{inner} {self.op_outer} {self.c}" if self.is_left else f"{self.c} {self.op_outer} {inner}"

    def inner_value(self) -> int:
        return apply_op(self.a, self.op_inner, self.b)

    def value(self) -> int:
        inner = self.inner_value()
        return apply_op(inner, self.op_outer, self.c) if self.is_left else apply_op(self.c, self.op_outer, inner)

    def worked_response(self) -> str:
        """The response the warm-up teaches: both steps without spaces, then the tagged answer."""
        inner = self.inner_value()
        step1 = f"{self.a}{self.op_inner}{self.b}={inner}"
        step2 = f"{inner}{self.op_outer}{self.c}" if self.is_left else f"{self.c}{self.op_outer}{inner}"
        return f"{step1}, {step2}={self.value()} <answer>{self.value()}</answer>"


def split_of(expression_text: str) -> str:
    # blake2b, not hash(): Python salts str hashes per process, and splits must never move.
    digest = hashlib.blake2b(expression_text.encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "little") % TEST_ONE_IN == 0 else "train"


def all_expressions() -> list[Expression]:
    """Every expression of the task, in a fixed order. Two '*' are excluded to keep results small."""
    operands = range(1, MAX_OPERAND + 1)
    return [
        Expression(a, op_inner, b, op_outer, c, is_left)
        for is_left in (True, False)
        for op_inner in OPS
        for op_outer in OPS
        if not (op_inner == "*" and op_outer == "*")
        for a in operands
        for b in operands
        for c in operands
    ]


@functools.lru_cache(maxsize=len(SPLITS))
def split_expressions(split: str) -> tuple[Expression, ...]:
    return tuple(e for e in all_expressions() if split_of(e.text()) == split)


def num_problems(split: str) -> int:
    """How many distinct problems `split` holds."""
    return len(split_expressions(split))


def render_prompt(expression_text: str) -> str:
    return PROMPT_TEMPLATE.format(expression=expression_text)


def make_expressions(split: str, num: int, seed: int = 0) -> list[Expression]:
    """`num` distinct expressions of `split`; a seeded shuffle, so any shorter list is a prefix."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pool = list(split_expressions(split))
    if not isinstance(num, int) or isinstance(num, bool) or not 0 <= num <= len(pool):
        raise ValueError(f"num must be an int in [0, {len(pool)}] for split {split!r}, got {num!r}")
    random.Random(seed).shuffle(pool)
    return pool[:num]


def make_problems(split: str, num: int, seed: int = 0) -> list[Problem]:
    """`num` problems of `split`; the answer is the integer result as a decimal string, e.g. "-12"."""
    return [Problem(render_prompt(e.text()), str(e.value())) for e in make_expressions(split, num, seed)]


def load_split(cfg, split: str) -> list[Problem]:
    """The task contract: every problem of `split` in the order `task.seed` shuffles them."""
    return make_problems(split, num_problems(split), cfg.task.seed)


def extract_answer(text: str) -> str | None:
    """The integer inside the last closed `<answer>...</answer>` (inner whitespace stripped), or None.

    The closing tag is searched first and its nearest opening tag after, so in
    `<answer>5 <answer>7</answer>` the answer is 7, and a trailing unclosed tag is ignored.
    """
    end = text.rfind(CLOSE_TAG)
    start = text.rfind(OPEN_TAG, 0, end) if end >= 0 else -1
    if start < 0:
        return None
    inner = text[start + len(OPEN_TAG):end].strip()
    return inner if INTEGER_RE.fullmatch(inner) else None


def tags_first_step(response: str, answer: str | None) -> bool:
    """True if the tagged `answer` is the result of the response's first worked step and not of its
    last (a response whose steps give the same result cannot show the habit, so it counts as False)."""
    if answer is None:
        return False
    results = [int(r) for r in STEP_RESULT_RE.findall(response[:response.rfind(CLOSE_TAG)])]
    return len(results) >= 2 and results[0] == int(answer) != results[-1]


def reward(response: str, label: str) -> dict[str, float]:
    """The plug-in contract: (decoded response, reference answer) -> reward and its parts."""
    answer = extract_answer(response)
    is_formatted = answer is not None
    is_correct = is_formatted and int(answer) == int(label)
    format_score = 1.0 if is_formatted else 0.0
    accuracy = 1.0 if is_correct else 0.0
    return {"reward": 0.1 * format_score + 0.9 * accuracy, "format": format_score, "accuracy": accuracy,
            "first_step": 1.0 if tags_first_step(response, answer) else 0.0}
