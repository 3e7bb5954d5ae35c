"""How a config value is read: TOML file values and `--section.key=value` overrides, each checked
against its field's type. Library module of `config.py`, standard library only.
"""

from __future__ import annotations

import json
import tomllib

from nano_miles.run.cli import UserError


class ConfigError(UserError):
    """A config file or override that cannot be used; the message names the key."""


def toml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value)


def parse_value(text: str):
    """TOML scalar if it parses as one (numbers, booleans, quoted strings, lists), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def coerce(section: str, key: str, value, default):
    where = f"{section}.{key}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, not {value!r}")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, not {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, not {value!r}")
        value = float(value)
    elif isinstance(default, str) and not isinstance(value, str):
        value = str(value)
    return value


def merge(raw: dict[str, dict], table: dict, origin: str) -> set[str]:
    """Merge `table` into `raw`; the "section.key"s it set."""
    for section, values in table.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: [{section}] must be a table")
        raw.setdefault(section, {}).update(values)
    return {f"{section}.{key}" for section, values in table.items() for key in values}


def parse_overrides(args: list[str]) -> dict[str, dict]:
    """['--trainer.lr=1e-3', ...] -> {'trainer': {'lr': 0.001}}."""
    table: dict[str, dict] = {}
    for arg in args:
        body = arg[2:] if arg.startswith("--") else arg
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(f"override {arg!r} must look like --section.key=value")
        dotted, text = body.split("=", 1)
        section, key = dotted.split(".", 1)
        table.setdefault(section, {})[key] = parse_value(text)
    return table
