"""Tasks: problem sets and their reward functions, plugged in by dotted path, and how prompts become ids.
Used as a library: `load_reward_fn("nano_miles.tasks.arithmetic:reward")(response, label)`.

A task module (`task.name`) provides `make_problems(split, num, seed)`, each problem with a `prompt`
and an `answer`, and `num_problems(split)`, how many distinct problems the split holds. A reward
function takes `(response: str, label: str)` and returns a dict of floats with at least the key
"reward"; other keys (e.g. "format", "accuracy") are logged as reward parts. A stage loads its
plug-ins first thing: one that does not import, or a task smaller than the config asks for, is a
UserError naming the key. Prompts are tokenized once, by the producer; from there only token ids
travel (never re-tokenized).
"""

import importlib
from collections.abc import Callable

from nano_miles.run.cli import UserError

RewardFn = Callable[[str, str], dict[str, float]]
TASK_FUNCTIONS = ("make_problems", "num_problems")


def split_dotted(dotted: str) -> tuple[str, str]:
    """'pkg.mod:fn' or 'pkg.mod.fn' -> ('pkg.mod', 'fn')."""
    module_name, sep, attr = dotted.partition(":") if ":" in dotted else dotted.rpartition(".")
    if not sep or not module_name or not attr:
        raise UserError(f"reward.fn {dotted!r} must look like 'package.module:function' "
                        "or 'package.module.function'")
    return module_name, attr


def load_reward_fn(dotted: str) -> RewardFn:
    """Import the reward function named by `dotted` (`reward.fn`); a UserError naming it if that fails."""
    module_name, attr = split_dotted(dotted)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"reward.fn {dotted!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"reward.fn {dotted!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(f"reward.fn {dotted!r}: {attr!r} is a {type(fn).__name__}, not callable")
    return fn


def load_task(name: str):
    """The task module named by `task.name`; a UserError naming it if it does not import or lacks
    the task functions."""
    try:
        task = importlib.import_module(name)
    except ImportError as e:
        raise UserError(f"task.name {name!r}: cannot import it ({e})") from None
    missing = [f for f in TASK_FUNCTIONS if not callable(getattr(task, f, None))]
    if missing:
        raise UserError(f"task.name {name!r}: a task module provides {' and '.join(TASK_FUNCTIONS)}; "
                        f"this one lacks {', '.join(missing)}")
    return task


def load_problems(task_cfg, split: str) -> list:
    """The `split` problems the config's [task] section asks for (num_train or num_test of them);
    asking for more than the task holds is a UserError naming the key and the task's size."""
    task = load_task(task_cfg.name)
    num = {"train": task_cfg.num_train, "test": task_cfg.num_test}[split]
    available = task.num_problems(split)
    if num > available:
        raise UserError(f"task.num_{split} must be at most {available} (the {split} problems of "
                        f"{task_cfg.name}), not {num}")
    return task.make_problems(split, num, task_cfg.seed)


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
