"""Reward functions, plugged in by dotted path: one (`reward.fn`) or several with weights (`reward.fns`).
Used as a library: `load_reward(cfg.reward)(response, label)`.

A reward function takes `(response: str, label: str)` and returns a dict of floats with at least
the key "reward"; any other key (e.g. "format", "accuracy") is logged as a reward part. Evaluation
reports held-out accuracy from the "accuracy" part when the function has one, and the mean reward
always. With `reward.fns = ["a:fn", "b:fn"]` and `reward.weights = [1.0, 0.2]` the reward is the
weighted sum, every function's parts are logged under its name (`math/accuracy`, `b/reward`), and
the plain "accuracy" and "format" parts are those of the first function that reports them. Reward
functions always run in the reward stage's forked worker, with its per-sample timeout; a sample the
function fails on scores 0, and a function that fails on a whole group, or on more than
`reward.max_failure_fraction` of the samples, stops the run (`worker.FailureLimit`).
Built in: `nano_miles.rewards.math:reward` (verifiable math answers) and the arithmetic task's own
`nano_miles.tasks.arithmetic:reward`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from nano_miles.run.cli import UserError

RewardFn = Callable[[str, str], dict[str, float]]
SHARED_PARTS = ("accuracy", "format")  # kept unprefixed from the first function that has them


def split_dotted(dotted: str, key: str = "reward.fn") -> tuple[str, str]:
    """'pkg.mod:fn' or 'pkg.mod.fn' -> ('pkg.mod', 'fn')."""
    module_name, sep, attr = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    if not sep or not module_name or not attr:
        raise UserError(f"{key} {dotted!r} must look like 'package.module:function' or 'package.module.function'")
    return module_name, attr


def load_reward_fn(dotted: str, key: str = "reward.fn") -> RewardFn:
    """Import the reward function named by `dotted`; a UserError naming it (and `key`) if that fails."""
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


def part_prefix(dotted: str) -> str:
    """What a function's parts are logged under: its name, or its module's for one called `reward`."""
    module_name, attr = split_dotted(dotted)
    return module_name.rsplit(".", 1)[-1] if attr == "reward" else attr


def weighted(named_fns: list[tuple[str, RewardFn]], weights: list[float]) -> RewardFn:
    """One reward function from several: the weighted sum, each one's parts under its name."""
    def combined(response: str, label: str) -> dict[str, float]:
        out = {"reward": 0.0}
        for (name, fn), weight in zip(named_fns, weights):
            parts = fn(response, label)
            out["reward"] += weight * float(parts["reward"])
            for key, value in parts.items():
                out[f"{name}/{key}"] = float(value)
                if key in SHARED_PARTS:
                    out.setdefault(key, float(value))
        return out
    return combined


def describe(reward_cfg) -> str:
    """The run's reward function as the config names it, for a message about it."""
    return f"reward.fns {reward_cfg.fns}" if reward_cfg.fns else f"reward.fn {reward_cfg.fn!r}"


def load_reward(reward_cfg) -> RewardFn:
    """The run's reward function from the [reward] section; a UserError naming the key if it cannot load."""
    if not reward_cfg.fns:
        return load_reward_fn(reward_cfg.fn)
    names = [part_prefix(d) for d in reward_cfg.fns]
    names = [n if names.count(n) == 1 else f"{n}{i}" for i, n in enumerate(names)]  # each its own parts
    fns = [load_reward_fn(d, f"reward.fns[{i}]") for i, d in enumerate(reward_cfg.fns)]
    return weighted(list(zip(names, fns)), reward_cfg.weights or [1.0] * len(fns))
