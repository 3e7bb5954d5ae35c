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


class OverrideText(str):
    """The value of a `--section.key=value` override as typed; `coerce` reads it as its field's type."""


def read_override(where: str, text: str, default):
    """An override's text as the type of the field it sets. A string field takes the text as typed
    (`--run.dir=1e3` is the directory "1e3", not "1000.0"), unquoting it if it is in TOML quotes; any
    other field reads it as one TOML value, and text that is none is left for the type check to name."""
    is_quoted = text[:1] in ("'", '"')
    if isinstance(default, str) and not is_quoted:
        return str(text)
    try:
        table = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError as e:
        table = {"error": str(e)}
    if set(table) != {"v"}:  # not a value, or a value and more keys after it (a newline in the text)
        if is_quoted:
            raise ConfigError(f"{where}: {text} opens a TOML string that does not parse "
                              f"({table.get('error', 'more than one value')}); drop the quotes or close them")
        return str(text)
    return table["v"]


def coerce(section: str, key: str, value, default):
    """`value` (from a TOML file, or an `OverrideText`) as the type of the field's `default`."""
    where = f"{section}.{key}"
    if isinstance(value, OverrideText):
        value = read_override(where, value, default)
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
        raise ConfigError(f"{where} must be a string, not {value!r} (a TOML string is in quotes)")
    return value


def merge(raw: dict[str, dict], table: dict, origin: str) -> set[str]:
    """Merge `table` into `raw`; the "section.key"s it set."""
    for section, values in table.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: [{section}] must be a table")
        raw.setdefault(section, {}).update(values)
    return {f"{section}.{key}" for section, values in table.items() for key in values}


def parse_overrides(args: list[str]) -> dict[str, dict]:
    """['--trainer.lr=1e-3', ...] -> {'trainer': {'lr': OverrideText('1e-3')}}: read when its field is known."""
    table: dict[str, dict] = {}
    for arg in args:
        body = arg[2:] if arg.startswith("--") else arg
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(f"override {arg!r} must look like --section.key=value")
        dotted, text = body.split("=", 1)
        section, key = dotted.split(".", 1)
        table.setdefault(section, {})[key] = OverrideText(text)
    return table
