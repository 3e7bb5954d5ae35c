"""A verifiable math reward: the response's final answer, compared with the label by value (math-verify).
Plug-in: `--reward.fn=nano_miles.rewards.math:reward`; as a library, `reward("... \\boxed{40}", "#### 40")`.

The final answer is taken, in this order of preference, from the last `\\boxed{...}`, the last
`<answer>...</answer>`, the last GSM8K-style `#### N` line, or else the last number in the text. A
label may be a bare answer (`40`, `\\frac{1}{2}`) or a GSM8K solution ending in `#### N` (only what
follows the last `####` counts). Values are compared exactly: plain numbers (integers, decimals,
fractions, thousands commas) as fractions, a plain number against an expression (`\\frac{1}{3}`) with
the expression's exact value (0.33 or 0.3333333 for 1/3 score 0), and two expressions by math-verify's
symbolic comparison. Parts: `accuracy` (1 if equal), `format` (1 if the answer was marked: boxed, tagged or
`####`, not just a last number), and `reward` = accuracy.

Every scan is linear in the response, and only the extracted answer (at most MAX_ANSWER_CHARS)
reaches the symbolic parser, so a megabyte of garbage costs milliseconds; the reward stage's
per-sample timeout still bounds whatever math-verify does.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_ANSWER_CHARS = 200  # a final answer longer than this is not one (and would be slow to parse)
MAX_BOX_TRIES = 8
BOXED = "\\boxed"
OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"
HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")
NUMBER_RE = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")
PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?(?:/[0-9]+)?|[-+]?\.[0-9]+")


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` with balanced braces (within MAX_ANSWER_CHARS), or None;
    only the last MAX_BOX_TRIES boxes are tried, so a response of unclosed boxes stays cheap."""
    start = text.rfind(BOXED + "{")
    for _ in range(MAX_BOX_TRIES):
        if start < 0:
            break
        depth = 0
        for i in range(start + len(BOXED), min(len(text), start + len(BOXED) + MAX_ANSWER_CHARS + 2)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len(BOXED) + 1:i]
        start = text.rfind(BOXED + "{", 0, start)  # unclosed: an earlier one may be whole
    return None


def last_tagged(text: str) -> str | None:
    end = text.rfind(CLOSE_TAG)
    start = text.rfind(OPEN_TAG, 0, end) if end >= 0 else -1
    return text[start + len(OPEN_TAG):end] if start >= 0 else None


def last_hashes(text: str) -> str | None:
    at = text.rfind("####")
    match = HASHES_RE.match(text, at) if at >= 0 else None
    return match.group(1) if match and match.group(1).strip() else None


def last_number(text: str) -> str | None:
    found = None
    for found in NUMBER_RE.finditer(text):
        pass
    return found.group(0) if found else None


def extract_answer(response: str) -> tuple[str | None, bool]:
    """(the final answer, whether it was marked as one); (None, False) when there is none."""
    for finder in (last_boxed, last_tagged, last_hashes):
        answer = finder(response)
        if answer is not None and answer.strip():
            return clean(answer), True
    number = last_number(response)
    return (clean(number), False) if number is not None else (None, False)


def label_answer(label: str) -> str:
    """A label's answer: what follows the last `####` of a worked solution, else the label itself."""
    return clean(label.rsplit("####", 1)[1] if "####" in label else label)


def clean(answer: str) -> str:
    answer = answer.strip().strip("$").strip().rstrip(".")
    return answer.removeprefix("\\(").removesuffix("\\)").strip()


def as_fraction(text: str) -> Fraction | None:
    """A plain number as an exact fraction ("1,234", "-0.50", "3/4"), or None if it is not one."""
    text = text.replace(" ", "")
    if not PLAIN_NUMBER_RE.fullmatch(text):
        return None
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def exact_value(parsed) -> Fraction | bool:
    """The exact rational value of a number math-verify parsed (`\\frac{2}{6}`, `2^{-1}`); False for a
    number without one (`\\sqrt{2}`), True for what is not a number (a set, a symbol)."""
    import sympy

    expr = parsed[0] if parsed else None
    if not isinstance(expr, sympy.Basic) or not expr.is_number:
        return True
    value = sympy.simplify(expr)
    if value.is_Rational:
        return Fraction(int(value.p), int(value.q))
    return Fraction(str(value)) if isinstance(value, sympy.Float) else False  # a decimal, as written


def is_equal(answer: str, expected: str) -> bool:
    if len(answer) > MAX_ANSWER_CHARS or len(expected) > MAX_ANSWER_CHARS:
        return False
    a, b = as_fraction(answer), as_fraction(expected)
    if a is not None and b is not None:
        return a == b
    from math_verify import parse, verify  # imported on first use: the reward worker pays once

    def parsed(text):
        return parse(f"${text}$", parsing_timeout=2) or parse(text, parsing_timeout=2)
    if a is not None or b is not None:  # one side a plain number, the other written otherwise
        value = exact_value(parsed(expected if b is None else answer))
        if value is not True:  # a number: equal exactly, or not at all (math-verify would round both
            # to 6 places: 0.3333333 is not 1/3, 1.41421356 is not sqrt(2))
            return value == (a if a is not None else b)
    gold, pred = parsed(expected), parsed(answer)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=2))


def reward(response: str, label: str) -> dict[str, float]:
    """The plug-in contract: (decoded response, label) -> reward and its parts (see the module doc)."""
    answer, is_marked = extract_answer(response)
    accuracy = 1.0 if answer is not None and is_equal(answer, label_answer(str(label))) else 0.0
    return {"reward": accuracy, "format": 1.0 if is_marked else 0.0, "accuracy": accuracy}
