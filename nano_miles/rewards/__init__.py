"""Reward functions, plugged in by dotted path: one (`reward.fn`) or several with weights (`reward.fns`).
Used as a library: `load_reward(cfg.reward)(response, label)`.

A reward function takes `(response: str, label: str)`, or `(prompt, response, label, **fields)`
(chosen by its signature: a first parameter named `prompt`, as TRL passes dataset columns), and
returns a float or a dict of floats with at least the key "reward"; any other key (e.g. "format",
"accuracy") is logged as a reward part. The response is the model's last turn. The second form also
gets the prompt as the task gives it (text or chat messages), `turns` (the whole trajectory after the
prompt: [{"role": "assistant" or "environment", "content": text}], the model's turns and what its
environment wrote between them), the record's other fields (a data file's other keys) and the facts
below: every one with `**fields`, else those it names. Evaluation
reports held-out accuracy from the "accuracy" part when the function has one, and the mean reward
always. With `reward.fns = ["a:fn", "b:fn"]` and `reward.weights = [1.0, 0.2]` the reward is the
weighted sum, every function's parts are logged under its name (`math/accuracy`, `b/reward`), and
the plain "accuracy" and "format" parts are those of the first function that reports them. Reward
functions always run in forked workers (`reward.num_workers` of them, scoring a group's samples in
parallel), with a per-sample timeout; a sample the function fails on scores 0, and a function that
fails on a whole group, or on more than `reward.max_failure_fraction` of the samples, stops the run
(`worker.FailureLimit`).
Built in: `nano_miles.rewards.math:reward` (verifiable math answers), `nano_miles.rewards.overlong:reward`
(DAPO's soft length penalty, to add to another through `reward.fns`) and the arithmetic task's own
`nano_miles.tasks.arithmetic:reward`.

A function may also ask for facts the text does not show, by declaring keyword-only parameters named
in REWARD_KEYWORDS: the sample's `num_response_tokens` and `finish_reason` ("stop" or "length"),
`rollout.max_new_tokens`, and the `[reward]` settings of the built-in shaping functions. Each function
gets exactly the keywords it declares; one it declares without a default that is not in the list is
an error when the function loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from nano_miles.run.cli import UserError
from nano_miles.run.plugins import load_function, split_dotted

RewardFn = Callable[..., dict[str, float]]  # (response, label), or (response, label, facts) once loaded
SHARED_PARTS = ("accuracy", "format")  # kept unprefixed from the first function that has them
REWARD_KEYWORDS = ("num_response_tokens", "finish_reason", "max_new_tokens", "overlong_buffer", "overlong_penalty")


def sample_facts(cfg, num_response_tokens: int, finish_reason: str, *, prompt=None, turns: list | None = None,
                 fields: dict | None = None) -> dict:
    """What a reward function may be given besides (response, label), for one sample of a run: the
    REWARD_KEYWORDS, and for the `(prompt, response, label, **fields)` form the prompt, the turns and
    the record's fields (a field named like a fact gives way to the fact)."""
    return {**(fields or {}), "prompt": prompt, "turns": turns or [],
            "num_response_tokens": num_response_tokens, "finish_reason": finish_reason,
            "max_new_tokens": cfg.rollout.max_new_tokens, "overlong_buffer": cfg.reward.overlong_buffer,
            "overlong_penalty": cfg.reward.overlong_penalty}


def sample_turns(sample, decode) -> list[dict]:
    """A sample's trajectory as the reward function's `turns`: the model's turns ("assistant") and the
    environment's ("environment"), in order, as text."""
    return [{"role": "assistant" if is_model else "environment", "content": decode(sample.response_tokens[a:b])}
            for a, b, is_model in sample.turns]


def scored_facts(cfg, sample, decode, problem, *, takes_record: bool) -> dict:
    """`sample_facts` of one sample to score; its record's prompt and fields and its decoded turns only
    for a function that reads them (`takes_record`), so no other one pays for decoding every turn."""
    if not takes_record or problem is None:
        return sample_facts(cfg, len(sample.response_tokens), sample.finish_reason)
    return sample_facts(cfg, len(sample.response_tokens), sample.finish_reason, prompt=problem.prompt,
                        turns=sample_turns(sample, decode), fields=problem.fields)


def response_text(sample, decode) -> str:
    """What a reward function reads as the response: the text of the model's last turn (of a
    single-turn sample, the whole response), special tokens dropped by `decode`."""
    start, end = next((a, b) for a, b, is_model in reversed(sample.turns) if is_model)
    return decode(sample.response_tokens[start:end])


def declared_keywords(fn, key: str) -> tuple[str, ...]:
    """The REWARD_KEYWORDS `fn` declares as keyword-only parameters; a UserError naming `key` for one it
    needs (no default) that is not among them."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: it takes (response, label)
        return ()
    keyword_only = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = [p.name for p in keyword_only if p.name not in REWARD_KEYWORDS and p.default is inspect.Parameter.empty]
    if unknown:
        raise UserError(f"{key}: keyword parameter {unknown[0]!r} is not one a reward function can be given "
                        f"(one of {', '.join(REWARD_KEYWORDS)})")
    return tuple(p.name for p in keyword_only if p.name in REWARD_KEYWORDS)


def as_parts(out) -> dict:
    """A reward function's answer as its parts: a dict as it is, a number as {"reward": it}."""
    if isinstance(out, dict):
        return out
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return {"reward": out}
    raise TypeError(f"a reward function returns a float or a dict of floats, not {type(out).__name__}")


def takes_record(fn) -> bool:
    """Whether `fn` has the `(prompt, response, label, **fields)` form (its first parameter is `prompt`)."""
    try:
        first = next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):  # a builtin or C callable: it takes (response, label)
        return False
    return first == "prompt"


def with_facts(fn, key: str):
    """`fn` as a function of (response, label, facts=None) that passes it what its form asks for and
    returns its parts (`fn` itself if it is one already: what `load_reward` returns)."""
    if getattr(fn, "takes_facts", False):
        return fn
    is_record_form = takes_record(fn)
    if is_record_form:
        params = list(inspect.signature(fn).parameters.values())[3:]
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        names = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}

        def call(response: str, label: str, facts: dict | None = None) -> dict[str, float]:
            rest = dict(facts or {})
            prompt = rest.pop("prompt", None)
            return as_parts(fn(prompt, response, label, **(rest if takes_all else
                                                           {n: v for n, v in rest.items() if n in names})))
    else:
        keywords = declared_keywords(fn, key)

        def call(response: str, label: str, facts: dict | None = None) -> dict[str, float]:
            if not keywords:
                return as_parts(fn(response, label))
            if facts is None:
                raise TypeError(f"{key} needs {', '.join(keywords)}, which only a scored sample has")
            return as_parts(fn(response, label, **{n: facts[n] for n in keywords}))
    call.takes_facts, call.takes_record = True, is_record_form
    return call


def part_prefix(dotted: str) -> str:
    """What a function's parts are logged under: its name, or its module's for one called `reward`."""
    module_name, attr = split_dotted(dotted)
    return module_name.rsplit(".", 1)[-1] if attr == "reward" else attr


def weighted(named_fns: list[tuple[str, RewardFn]], weights: list[float]) -> RewardFn:
    """One reward function from several (each taking `facts`, as `with_facts` makes them): the weighted
    sum, each one's parts under its name."""
    def combined(response: str, label: str, facts: dict | None = None) -> dict[str, float]:
        out = {"reward": 0.0}
        for (name, fn), weight in zip(named_fns, weights):
            parts = fn(response, label, facts)
            out["reward"] += weight * float(parts["reward"])
            for key, value in parts.items():
                out[f"{name}/{key}"] = float(value)
                if key in SHARED_PARTS:
                    out.setdefault(key, float(value))
        return out
    combined.takes_facts = True
    combined.takes_record = any(fn.takes_record for _, fn in named_fns)
    return combined


def describe(reward_cfg) -> str:
    """The run's reward function as the config names it, for a message about it."""
    return f"reward.fns {reward_cfg.fns}" if reward_cfg.fns else f"reward.fn {reward_cfg.fn!r}"


def load_reward(reward_cfg) -> RewardFn:
    """The run's reward function from the [reward] section; a UserError naming the key if it cannot load."""
    if not reward_cfg.fns:
        return with_facts(load_function(reward_cfg.fn, "reward.fn"), "reward.fn")
    names = [part_prefix(d) for d in reward_cfg.fns]
    names = [n if names.count(n) == 1 else f"{n}{i}" for i, n in enumerate(names)]  # each its own parts
    fns = [with_facts(load_function(d, f"reward.fns[{i}]"), f"reward.fns[{i}]") for i, d in enumerate(reward_cfg.fns)]
    return weighted(list(zip(names, fns)), reward_cfg.weights or [1.0] * len(fns))
