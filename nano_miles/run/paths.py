"""What the config's paths must be on disk, looked up at every entry point's start (`parse_config`).

Library module of `config.py`, standard library only: the sections check values alone, so a config
can be built and printed on a machine without these paths; an entry point that reads the config then
finds here, in one line naming the key, a path a stage would trip over later: a model directory that
lacks a part, a run directory that is a file or cannot be written, a key directory without its keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nano_miles.run.cli import UserError

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # what from_pretrained loads
TOKENIZER_FILES = ("tokenizer*", "vocab*", "*.tiktoken", "*.model")  # what AutoTokenizer reads, in its many forms
CURVE_FILES = ("server.key", "server.key_secret", "client.key_secret")  # `python -m nano_miles.run.keys` writes them
MAKE_KEYS = "python -m nano_miles.run.keys DIR makes them"


def model_dir_problem(path: Path, *, needs_tokenizer: bool = True) -> str | None:
    """What keeps `path` from being a Hugging Face model directory the stages load, or None: a
    config.json naming its model_type, weights, and (for the stages that tokenize) a tokenizer.
    Checked before transformers, which takes a missing directory for a hub id, and a missing part for
    a traceback deep in its loader."""
    if not path.is_dir():
        return "no such directory" if not path.exists() else "not a directory"
    config = path / "config.json"
    if not config.is_file():
        return "no config.json there, not a Hugging Face model directory"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return f"its config.json is not readable as JSON ({e})"
    if not isinstance(data, dict) or not data.get("model_type"):
        return "its config.json has no model_type (transformers cannot tell which model it is)"
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        return f"no weights there ({' or '.join(WEIGHT_FILES)})"
    if needs_tokenizer and not any(any(path.glob(pattern)) for pattern in TOKENIZER_FILES):
        return "no tokenizer there (tokenizer.json, tokenizer.model, vocab.json, ...)"
    return None


def writable_dir_problem(path: Path) -> str | None:
    """What keeps `path` from being a directory this process can write, or create, or None."""
    if path.exists():
        if not path.is_dir():
            return "is a file, not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable here"
    existing = next(p for p in path.parents if p.exists())  # "/" exists
    if not existing.is_dir():
        return f"cannot be made: {existing} is a file"
    return None if os.access(existing, os.W_OK | os.X_OK) else f"cannot be made: {existing} is not writable here"


def curve_dir_problem(path: Path) -> str | None:
    """What keeps `path` from holding the CURVE keys every socket loads, or None."""
    if not path.is_dir():
        return "is not a directory" if path.exists() else "does not exist"
    missing = [] if (path / "allowed").is_dir() else ["allowed/"]
    missing += [name for name in CURVE_FILES if not ((path / name).is_file() and os.access(path / name, os.R_OK))]
    return f"holds no readable {', '.join(missing)}" if missing else None


def check_paths(cfg, *, needs_tokenizer: bool = True) -> None:
    """Paths a stage would trip over later, looked up on disk (the sections check values only, so a
    config can be built and printed on a machine without them). The engines take token ids and never
    read a tokenizer (`needs_tokenizer=False`)."""
    problem = model_dir_problem(cfg.model_dir, needs_tokenizer=needs_tokenizer)
    if problem:
        raise UserError(f"model.path {str(cfg.model_dir)!r}: {problem}")
    problem = writable_dir_problem(cfg.run_dir)
    if problem:
        raise UserError(f"run.dir {cfg.run.dir!r} {problem}")
    if cfg.trainer.resume_from and not Path(cfg.trainer.resume_from).is_dir():
        raise UserError(f"trainer.resume_from {cfg.trainer.resume_from!r} is not a directory "
                        "(a checkpoint, or a run directory with checkpoints/)")
    problem = cfg.security.curve_dir and curve_dir_problem(Path(cfg.security.curve_dir))
    if problem:
        raise UserError(f"security.curve_dir {cfg.security.curve_dir!r} {problem} ({MAKE_KEYS})")
