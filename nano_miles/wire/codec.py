"""What every nano-miles message shares: msgpack framing, the schema version, limits, WireError, group ids.

Library module under `data.py` (rollout and scored groups) and `control.py` (commands and replies);
it needs no numpy and no torch. Test: `pytest tests/test_wire.py`.

A group id names a dataset position: `e<epoch>-i<index>`. Every re-issue of a prompt carries the same
id, so duplicates are dropped by id; `group_id_at` / `position_of` are the one mapping between the two.
"""

from __future__ import annotations

import re

import msgpack

SCHEMA_VERSION = 4  # 2: every group carries its run's id; 3: scored groups carry no advantages;
                    # 4: a sample is a trajectory with a per-token loss mask
KNOWN_SCHEMA_VERSIONS = (2, 3, 4)  # v2 and v3 decode as single-turn v4 (v2's advantages: an unknown key)

# Limits. The byte limit is checked before unpacking; the others also bound what msgpack allocates.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_SAMPLES_PER_GROUP = 256              # G; GRPO uses 4..64
MAX_TOKENS_PER_SEQUENCE = 256 * 1024     # prompt + one response
MAX_MAP_ITEMS = 256                      # metadata, timestamps, reward_parts, any map
MAX_STR_BYTES = 1024 * 1024              # one string, e.g. a reference answer or a test suite
MAX_ID_CHARS = 128                       # run_id, req_id, incarnation

_GROUP_ID = re.compile(r"e(0|[1-9][0-9]{0,17})-i(0|[1-9][0-9]{0,17})")


class WireError(ValueError):
    """A message that cannot be encoded or decoded; the text starts with the offending field."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_count(value: object, where: str) -> int:
    """`value` if it is an int >= 0 (a bool is refused, though Python counts it as an int)."""
    if type(value) is not int or value < 0:
        raise WireError(f"{where}: expected an int >= 0, got {_show(value)}")
    return value


def check_text_id(value: object, where: str) -> str:
    """`value` if it is a string of 1..MAX_ID_CHARS chars (a run id, request id or incarnation)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_CHARS:
        raise WireError(f"{where}: expected a string of 1..{MAX_ID_CHARS} chars, got {_show(value)}")
    return value


def make_group_id(epoch: int, index: int) -> str:
    """The id of the group for dataset item `index` in `epoch`, e.g. "e0-i123"."""
    return f"e{check_count(epoch, 'epoch')}-i{check_count(index, 'index')}"


def parse_group_id(group_id: str, where: str = "group_id") -> tuple[int, int]:
    """(epoch, index) back from a group id; WireError unless it is exactly what make_group_id writes."""
    m = _GROUP_ID.fullmatch(group_id) if isinstance(group_id, str) else None
    if m is None:
        raise WireError(f"{where}: {_show(group_id)} is not of the form e<epoch>-i<index>")
    return int(m[1]), int(m[2])


def group_id_at(position: int, num_items: int) -> str:
    """The id of the group at `position` of the endless dataset stream (epoch after epoch): the one
    mapping between positions and ids (a group id is its position, written as epoch and index)."""
    return make_group_id(position // num_items, position % num_items)


def position_of(group_id: str, num_items: int) -> int:
    epoch, index = parse_group_id(group_id)
    return epoch * num_items + index


def unpack_message(data: object, kinds: tuple[str, ...], *, max_array_items: int,
                   max_map_items: int = MAX_MAP_ITEMS, versions: tuple[int, ...] = KNOWN_SCHEMA_VERSIONS) -> dict:
    """Size-check, unpack and check `v` and `kind` of one message; the map, or WireError."""
    try:
        num_bytes = memoryview(data).nbytes
    except TypeError:
        raise WireError(f"message: expected bytes, got {type(data).__name__}") from None
    if num_bytes > MAX_MESSAGE_BYTES:
        raise WireError(f"message: {num_bytes} bytes > MAX_MESSAGE_BYTES {MAX_MESSAGE_BYTES}")
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0,
                            max_str_len=MAX_STR_BYTES, max_bin_len=4 * MAX_TOKENS_PER_SEQUENCE,
                            max_array_len=max_array_items, max_map_len=max_map_items)
    except (ValueError, BufferError) as e:  # every msgpack unpack error is a ValueError subclass
        raise WireError(f"message: not a valid msgpack message ({type(e).__name__}: {e})") from e
    if not isinstance(m, dict):
        raise WireError(f"message: expected a map, got {type(m).__name__}")
    version = m.get("v")
    if type(version) is not int or version not in versions:
        raise WireError(f"v: unknown schema version {_show(version)} (known: {list(versions)})")
    kind = get(m, "kind", str, "")
    if kind not in kinds:
        raise WireError(f"kind: expected {' or '.join(map(repr, kinds))}, got {kind!r}")
    return m


def get(m: dict, key: str, types: type | tuple[type, ...], prefix: str) -> object:
    """m[key], or WireError naming `prefix + key` when it is missing or of the wrong type."""
    if key not in m:
        raise WireError(f"{prefix}{key}: missing")
    value = m[key]
    if not isinstance(value, types) or (isinstance(value, bool) and types is not bool):
        raise WireError(f"{prefix}{key}: expected {getattr(types, '__name__', types)}, got {type(value).__name__}")
    return value


