"""What a config field accepts: a rule per field, declared next to its default as `checked(default, rule)`.

Library module of `config.py`, whose sections check every field against its rule when they are built,
so a value a stage would trip over stops the process at its start, in one line naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nano_miles.run.values import ConfigError


@dataclass(frozen=True)
class Rule:
    """What a config field accepts: `accepts(value)`, and in words for the error (`allowed`)."""
    allowed: str
    accepts: Callable[[Any], bool]


def checked(default, rule: Rule):
    """A field: its default and the rule its value must meet (a list default becomes a factory, since
    dataclasses refuse a mutable default shared by every instance)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


def at_least(low: float) -> Rule:
    return Rule(f">= {low}", lambda v: math.isfinite(v) and v >= low)  # TOML has nan and inf


def above(low: float) -> Rule:
    return Rule(f"> {low}", lambda v: math.isfinite(v) and v > low)


def between(low: int, high: int, why: str = "") -> Rule:
    return Rule(f"in [{low}, {high}]" + (f" ({why})" if why else ""), lambda v: low <= v <= high)


def one_of(*choices: str) -> Rule:
    return Rule(f"one of {', '.join(choices)}", lambda v: v in choices)


def matching(pattern: str, allowed: str) -> Rule:
    return Rule(allowed, lambda v: re.fullmatch(pattern, v) is not None)


def _is_shell_words(text: str) -> bool:
    try:
        shlex.split(text)
    except ValueError:  # an unbalanced quote
        return False
    return True


ANY_TEXT = Rule("a string", lambda v: isinstance(v, str))  # paths: paths.check_paths looks them up on disk
NON_EMPTY = Rule("a non-empty string", lambda v: bool(v.strip()))
BOOL = Rule("true or false", lambda v: isinstance(v, bool))
FRACTION = Rule("in (0, 1]", lambda v: 0 < v <= 1)
OPEN_FRACTION = Rule("in (0, 1)", lambda v: 0 < v < 1)
PORT = Rule("a TCP port in [1, 65535]", lambda v: 1 <= v <= 65535)
PORT_OR_FREE = Rule("a TCP port in [0, 65535] (0: any free one)", lambda v: 0 <= v <= 65535)
HOST = matching(r"\S+", "a host name or address")
DEVICE = matching(r"cpu|cuda(:[0-9]+)?", "cpu, cuda or cuda:N")
ENDPOINT = matching(r"tcp://\S+:[0-9]+|ipc://\S+", "a ZeroMQ endpoint, tcp://HOST:PORT or ipc://PATH")
URL = r"http://\S+"
URLS = Rule('a list of "http://host:port" strings',
            lambda v: isinstance(v, list) and all(isinstance(u, str) and re.fullmatch(URL, u) for u in v))
URL_OR_EMPTY = matching(f"|{URL}", '"" or http://host:port')
MODULE = matching(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", "a dotted module name, e.g. nano_miles.tasks.arithmetic")
FUNCTION_RE = r"[A-Za-z_][\w.]*[:.][A-Za-z_]\w*"
FUNCTION = matching(FUNCTION_RE, "package.module:function")
FUNCTIONS = Rule('a list of "package.module:function" strings',
                 lambda v: isinstance(v, list) and all(isinstance(f, str) and re.fullmatch(FUNCTION_RE, f) for f in v))
NUMBERS = Rule("a list of finite numbers", lambda v: isinstance(v, list) and all(
    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v))
SHELL_WORDS = Rule("shell words with balanced quotes", _is_shell_words)
TOP_K = Rule("-1 (off) or >= 1", lambda v: v == -1 or v >= 1)
DROPOUT = Rule("in [0, 1)", lambda v: 0 <= v < 1)
NAMES = Rule("a non-empty list of module names", lambda v: isinstance(v, list) and bool(v) and all(
    isinstance(n, str) and re.fullmatch(r"[A-Za-z_]\w*", n) for n in v))


class Section:
    """A config section checks every field against its rule (above) when it is built, so a value
    a stage would trip over stops the process at its start; the error names `section.key` (the section
    is the class name without 'Config'), the value and what is allowed."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            rule, value = f.metadata["rule"], getattr(self, f.name)
            if not rule.accepts(value):
                self.refuse(f.name, rule.allowed, value)

    def refuse(self, key: str, allowed: str, value):
        section = type(self).__name__.removesuffix("Config").lower()
        raise ConfigError(f"{section}.{key} must be {allowed}, not {value!r}")
