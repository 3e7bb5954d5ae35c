"""A user's own data as a task: prompts and labels read from JSONL, JSON, Parquet or a `datasets` directory.
Used as `--task.name=nano_miles.tasks.files --task.train_file=data/train.jsonl --task.prompt_key=question
--task.label_key=answer` (the keys of a GSM8K-style file).

`task.prompt_key` names the prompt (text, or a list of {"role", "content"} chat messages, which need
`task.chat_template`), `task.label_key` the label handed to the reward function; both may be dotted
paths into nested records (`reward_model.ground_truth`). JSONL and JSON are read with the standard
library; Parquet and `datasets.save_to_disk` directories need the `datasets` package
(`pip install 'nano-miles[data]'`).

The train split is shuffled by `run.seed`; group ids are positions in that order, so every process
and every restart agrees on which problem a group is. The test split is `task.test_file` or,
without one, a held-out slice of the train file: the `task.num_test` records (then at least 1)
whose prompts hash lowest, the same slice whatever the seed or the file's order. A record that cannot be used (missing
key, empty prompt, invalid JSON) stops the stage reading it with one line naming the file, the
record's line and the key: nothing is skipped without a word.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from nano_miles.run.cli import UserError
from nano_miles.tasks import Problem

JSON_SUFFIXES = (".jsonl", ".json")
NEEDS_DATASETS = "needs the datasets package: pip install 'nano-miles[data]' (or pip install datasets)"


def field_at(record: dict, key: str):
    """`record[key]`, or the value at a dotted path into nested records; KeyError if absent."""
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def read_json_records(path: Path):
    """(line number, record) of a JSONL file, or of a JSON file holding one list of records."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        yield from ((i + 1, r) for i, r in enumerate(records))  # the record's position in the list
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None


def read_dataset_records(path: Path, split: str):
    """(row number, record) of a Parquet file or a `datasets.save_to_disk` directory."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"{path}: reading {'Parquet' if path.is_file() else 'a datasets directory'} "
                        f"{NEEDS_DATASETS}") from None
    datasets.disable_progress_bars()
    if path.is_file():
        data = datasets.Dataset.from_parquet(str(path))
    else:
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise UserError(f"{path}: a DatasetDict with splits {', '.join(data)}, no {split!r}")
            data = data[split]
    yield from ((i + 1, r) for i, r in enumerate(data))


def read_problems(path_text: str, key_names: tuple[str, str], split: str) -> list[Problem]:
    """Every record of the file as a Problem; a UserError naming file, line and key for a bad one."""
    path = Path(path_text).expanduser()
    if not path.exists():
        raise UserError(f"{path}: no such file (task.{'test' if split == 'test' else 'train'}_file)")
    if path.is_file() and path.suffix in JSON_SUFFIXES:
        rows = read_json_records(path)
    elif path.is_dir() or path.suffix == ".parquet":
        rows = read_dataset_records(path, split)
    else:
        raise UserError(f"{path}: unknown format; use .jsonl, .json, .parquet or a datasets directory")
    (prompt_key, label_key), problems = key_names, []
    for number, record in rows:
        where = f"{path}:{number}"
        if not isinstance(record, dict):
            raise UserError(f"{where}: a record must be a JSON object, not {type(record).__name__}")
        values = []
        for key, option in ((prompt_key, "task.prompt_key"), (label_key, "task.label_key")):
            try:
                values.append(field_at(record, key))
            except KeyError:
                raise UserError(f"{where}: no key {key!r} ({option}); the record has "
                                f"{', '.join(map(repr, record)) or 'no keys'}") from None
        prompt, label = values
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt):
            prompt = tuple(dict(m) for m in prompt)
            is_empty = not any(str(m["content"]).strip() for m in prompt)
        elif isinstance(prompt, str):
            is_empty = not prompt.strip()
        else:
            raise UserError(f"{where}: {prompt_key!r} must be text or a list of chat messages, "
                            f"not {type(prompt).__name__}")
        if is_empty:
            raise UserError(f"{where}: empty prompt under {prompt_key!r}")
        if label is None:
            raise UserError(f"{where}: {label_key!r} is null")
        problems.append(Problem(prompt, label if isinstance(label, str) else json.dumps(label)))
    if not problems:
        raise UserError(f"{path}: no records")
    return problems


def prompt_hash(problem: Problem) -> bytes:
    text = problem.prompt if isinstance(problem.prompt, str) else json.dumps(problem.prompt, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def load_split(cfg, split: str) -> list[Problem]:
    """The task contract (see the module doc)."""
    t = cfg.task
    if not t.train_file:
        raise UserError("task.train_file must name the data file (.jsonl, .json, .parquet or a datasets "
                        "directory) when task.name is nano_miles.tasks.files")
    keys = (t.prompt_key, t.label_key)
    if split == "test" and t.test_file:
        return read_problems(t.test_file, keys, "test")
    problems = read_problems(t.train_file, keys, "train")
    if not t.test_file:  # the held-out slice: chosen by content, so no seed or file order moves it
        if t.num_test == 0:  # "all of them" has no meaning for a slice cut from the train file
            raise UserError("task.num_test = 0 evaluates the whole test file, and there is none: set "
                            f"task.test_file, or task.num_test > 0 to hold out that many records of {t.train_file}")
        if len(problems) <= t.num_test:
            raise UserError(f"{t.train_file} holds {len(problems)} records: holding out task.num_test = "
                            f"{t.num_test} for evaluation leaves none to train on (set task.test_file, "
                            "or a smaller task.num_test)")
        order = sorted(range(len(problems)), key=lambda i: (prompt_hash(problems[i]), i))
        held_out = set(order[:t.num_test])
        if split == "test":
            return [problems[i] for i in sorted(held_out)]
        problems = [p for i, p in enumerate(problems) if i not in held_out]
    random.Random(cfg.run.seed).shuffle(problems)
    return problems
