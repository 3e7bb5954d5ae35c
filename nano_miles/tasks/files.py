"""A user's own data as a task: prompts and labels read from JSONL, JSON, Parquet or a `datasets` directory.
Used as `--task.name=nano_miles.tasks.files --task.train_file=data/train.jsonl --task.prompt_key=question
--task.label_key=answer` (the keys of a GSM8K-style file).

`task.prompt_key` names the prompt (text, or a list of {"role", "content"} chat messages of the roles
`CHAT_ROLES`, which need `task.chat_template`), `task.label_key` the label handed to the reward
function (text, or a number it gets as text); both may be dotted
paths into nested records (`reward_model.ground_truth`). JSONL and JSON are read with the standard
library; Parquet and `datasets.save_to_disk` directories need the `datasets` package
(`pip install 'nano-miles[data]'`).

The train split is shuffled by `run.seed`; group ids are positions in that order, so every process
and every restart agrees on which problem a group is. The test split is `task.test_file` or,
without one, a held-out slice of the train file: the `task.num_test` records (then at least 1)
whose prompts hash lowest, the same slice whatever the seed or the file's order. A record that cannot
be used (missing key, empty prompt, invalid JSON, text not UTF-8, malformed chat messages, a label
that is a list) stops the stage reading it with one line naming the file, the record's line and the
key, and so does a file that cannot be read whole (a damaged Parquet file, a directory that is not
a datasets directory): nothing is skipped without a word.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from nano_miles.run.cli import UserError
from nano_miles.tasks import Problem
from nano_miles.tasks.prompts import CHAT_ROLES

JSON_SUFFIXES = (".jsonl", ".json")
DATASETS_MARKS = ("dataset_dict.json", "state.json")  # what datasets' save_to_disk writes (DatasetDict, Dataset)
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


def read_text(path: Path) -> str:
    """The file as UTF-8 text; a UserError naming the file (and the line of a byte that is not UTF-8)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8") from None


def read_json_records(path: Path):
    """(line number, record) of a JSONL file, or of a JSON file holding one list of records."""
    text = read_text(path)
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
    what = "Parquet" if path.is_file() else "a datasets directory"
    if path.is_dir() and not any((path / name).is_file() for name in DATASETS_MARKS):
        raise UserError(f"{path}: a directory, but not one datasets' save_to_disk wrote (no "
                        f"{' or '.join(DATASETS_MARKS)}); name a .jsonl, .json or .parquet file, or such a directory")
    try:
        import datasets
    except ImportError:
        raise UserError(f"{path}: reading {what} {NEEDS_DATASETS}") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its error log would be a second line
    try:
        if path.is_file():
            data = datasets.Dataset.from_parquet(str(path))
        else:
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise UserError(f"{path}: a DatasetDict with splits {', '.join(data)}, no {split!r}")
                data = data[split]
        rows = list(data)  # read whole here, where a damaged file can still be named
    except (ValueError, OSError) as e:  # pyarrow's errors for a damaged or foreign file are both
        raise UserError(f"{path}: not readable as {what} ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]})") from None
    yield from ((i + 1, r) for i, r in enumerate(rows))


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
        if isinstance(prompt, list) and prompt:
            problem = next(filter(None, (message_problem(m) for m in prompt)), None)
            if problem:
                raise UserError(f"{where}: chat messages under {prompt_key!r} must {problem}")
            prompt = tuple(dict(m) for m in prompt)
            is_empty = not any(m["content"].strip() for m in prompt)
        elif isinstance(prompt, str):
            is_empty = not prompt.strip()
        else:
            raise UserError(f"{where}: {prompt_key!r} must be text or a list of chat messages, "
                            f"not {type(prompt).__name__}")
        if is_empty:
            raise UserError(f"{where}: empty prompt under {prompt_key!r}")
        if label is None:
            raise UserError(f"{where}: {label_key!r} is null")
        if isinstance(label, bool) or not isinstance(label, (str, int, float)):
            raise UserError(f"{where}: {label_key!r} must be text or a number (the reward function gets it "
                            f"as text), not {type(label).__name__}")
        fields = {k: v for k, v in record.items() if k not in (prompt_key, label_key)}  # for the reward function
        problems.append(Problem(prompt, label if isinstance(label, str) else json.dumps(label), fields))
    if not problems:
        raise UserError(f"{path}: no records")
    return problems


def message_problem(message) -> str | None:
    """What keeps `message` from being a chat message a template renders ("be ...", "have ..."), or None."""
    if not isinstance(message, dict) or not {"role", "content"} <= set(message):
        return f'be {{"role", "content"}} objects, not {json.dumps(message, default=str)[:80]}'
    if message["role"] not in CHAT_ROLES:
        return f"have a role of {', '.join(CHAT_ROLES[:-1])} or {CHAT_ROLES[-1]}, not {message['role']!r}"
    if not isinstance(message["content"], str):
        return f"have text content, not {type(message['content']).__name__}"
    return None


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
