"""Plug-ins named by dotted path (`reward.fn`, `rollout.fn`): the one loader, with one-line errors.
Used as a library: `load_function("nano_miles.rewards.math:reward", "reward.fn")`.
"""

from __future__ import annotations

import importlib

from nano_miles.run.cli import UserError


def split_dotted(dotted: str, key: str = "reward.fn") -> tuple[str, str]:
    """'pkg.mod:fn' or 'pkg.mod.fn' -> ('pkg.mod', 'fn')."""
    module_name, sep, attr = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    if not sep or not module_name or not attr:
        raise UserError(f"{key} {dotted!r} must look like 'package.module:function' or 'package.module.function'")
    return module_name, attr


def load_function(dotted: str, key: str):
    """Import the function named by `dotted`; a UserError naming it (and `key`) if that fails."""
    module_name, attr = split_dotted(dotted, key)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{key} {dotted!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"{key} {dotted!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(f"{key} {dotted!r}: {attr!r} is a {type(fn).__name__}, not callable")
    return fn
