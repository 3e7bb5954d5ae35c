"""Tasks: problem sets and their reward functions, plugged in by dotted path, and how prompts become ids.
Used as a library: `load_reward_fn("nano_miles.tasks.arithmetic:reward")(response, label)`.

A task module (`task.name`) provides `make_problems(split, num, seed)`, each problem with a `prompt`
and an `answer`. A reward function takes `(response: str, label: str)` and returns a dict of floats
with at least the key "reward"; other keys (e.g. "format", "accuracy") are logged as reward parts.
Prompts are tokenized once, by the producer; from there only token ids travel (never re-tokenized).
"""

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str], dict[str, float]]


def split_dotted(dotted: str) -> tuple[str, str]:
    """'pkg.mod:fn' or 'pkg.mod.fn' -> ('pkg.mod', 'fn')."""
    module_name, sep, attr = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function path {dotted!r} must look like 'package.module:function' "
                         "or 'package.module.function'")
    return module_name, attr


def load_reward_fn(dotted: str) -> RewardFn:
    """Import the reward function named by `dotted`; ValueError naming the path if that fails."""
    module_name, attr = split_dotted(dotted)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward function path {dotted!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward function path {dotted!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward function path {dotted!r}: {attr!r} is a {type(fn).__name__}, not callable")
    return fn


def load_task(name: str):
    """The task module named in the config (it provides make_problems(split, num, seed))."""
    return importlib.import_module(name)


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def encode_prompts(tokenizer, problems) -> list[list[int]]:
    """Prompt text -> token ids, once; from here on only ids travel (never re-tokenized)."""
    return [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]


def make_decoder(tokenizer):
    """Token ids -> text for the reward function (special tokens such as EOS dropped)."""
    def decode(ids) -> str:
        return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
    return decode
