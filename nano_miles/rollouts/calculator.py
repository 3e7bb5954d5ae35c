"""The calculator tool: exact arithmetic on a parsed expression, run in a sandboxed process with a time limit.
Used as a library by the tool rollout (`nano_miles/rollouts/tools.py`); try `calculate("(7*4)+12")`.

The expression is parsed by the small grammar below (no `eval`, no Python at all): decimal numbers,
+ - * /, unary minus and parentheses, evaluated exactly with fractions. Whatever it is asked, the
answer is text for the model to read: the value (an integer, or a decimal of at most DECIMALS places),
or `error: <why>`. The parser bounds the work an expression can ask for (its length, nesting and the
size of every number), and it runs in a child process (`nano_miles/run/child.py`) with
TOOL_TIMEOUT_S per call, so that no call, however malformed, can hang or crash the rollout producer.
The child is spawned (the producer runs threads by then), so a script of your own that runs the tool
rollout in-process needs Python's `if __name__ == "__main__":` guard, as any spawning program does.

    expression := term (("+" | "-") term)*
    term       := factor (("*" | "/") factor)*
    factor     := "-" factor | "(" expression ")" | number
"""

from __future__ import annotations

import re
from fractions import Fraction

from nano_miles.run.child import CallFailed, ChildFunction

MAX_CHARS = 200           # longer expressions are refused unread
MAX_DEPTH = 32            # nested parentheses and minus signs
MAX_DIGITS = 30           # of any number read or computed
DECIMALS = 6              # places of a non-integer answer
TOOL_TIMEOUT_S = 2.0
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")


class CalculatorError(ValueError):
    """The expression cannot be evaluated; the text says why, for the model to read."""


def _tokens(text: str) -> list[str]:
    tokens = []
    for number, symbol in _TOKEN.findall(text):
        if symbol and symbol not in "+-*/()":
            raise CalculatorError(f"unexpected {symbol!r}")
        tokens.append(number or symbol)
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens, self.at, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> str | None:
        token = self.peek()
        self.at += 1
        return token

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = _bounded(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            if self.take() == "*":
                value = _bounded(value * self.factor())
            else:
                divisor = self.factor()
                if divisor == 0:
                    raise CalculatorError("division by zero")
                value = _bounded(value / divisor)
        return value

    def factor(self) -> Fraction:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"nested deeper than {MAX_DEPTH}")
        token = self.take()
        if token == "-":
            value = -self.factor()
        elif token == "(":
            value = self.expression()
            if self.take() != ")":
                raise CalculatorError("unclosed parenthesis")
        elif token is not None and token[0].isdigit():
            value = _bounded(Fraction(token))
        else:
            raise CalculatorError("expected a number" if token is None else f"unexpected {token!r}")
        self.depth -= 1
        return value


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise CalculatorError(f"a number of more than {MAX_DIGITS} digits")
    return value


def _show(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(round(value, DECIMALS)):.{DECIMALS}f}".rstrip("0").rstrip(".")


def calculate(expression: str) -> str:
    """The value of `expression` as text, or `error: <why>` (in this process: see `Calculator`)."""
    try:
        if len(expression) > MAX_CHARS:
            raise CalculatorError(f"longer than {MAX_CHARS} characters")
        parser = _Parser(_tokens(expression))
        value = parser.expression()
        if parser.peek() is not None:
            raise CalculatorError(f"unexpected {parser.peek()!r}")
        return _show(value)
    except CalculatorError as e:
        return f"error: {e}"


class Calculator:
    """`calculate` in a sandboxed child process, at most TOOL_TIMEOUT_S a call; shared by threads."""

    def __init__(self, timeout_s: float = TOOL_TIMEOUT_S):
        self.child = ChildFunction(calculate, timeout_s, start_method="spawn", name="calculator")

    def __call__(self, expression: str) -> str:
        try:
            return self.child(expression)
        except CallFailed as e:
            return f"error: {e.reason}"

    def stop(self) -> None:
        self.child.stop()
