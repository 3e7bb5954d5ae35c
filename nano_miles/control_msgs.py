"""Control-plane messages of nano-miles: the trainer's REQ commands and the rollout producer's REP replies.

Test: `pytest tests/test_wire.py`. Layout rules, limits and WireError are those of nano_miles/wire.py.

Every request carries a `req_id` that the client keeps across retries (Lazy Pirate), so a server that
already executed that request answers again without doing it twice. Every reply carries the server's
`incarnation`, a random id drawn at process start: a new value tells the client the server restarted
and lost its state, so the client re-sends `sync`.

Commands (arguments after the name; decoders refuse unknown commands and bad arguments, and ignore
unknown argument keys like unknown keys anywhere else):
    pause(mode)              mode in PAUSE_MODES, the engine's pause mode: "abort" ends in-flight
                             requests (their groups are re-issued), "retract" frees their KV cache and
                             re-prefills them after resume, "in_place" keeps them where they are
    resume(version)          version >= 0: the weight version the engine now serves
    commit(step, group_ids, dropped_group_ids)
                             step >= 0; group_ids: the groups trained at that step (now in the
                             trainer's model); dropped_group_ids: groups the trainer refused since its
                             last commit (stale, from weights it no longer has): issue them again
    sync(state)              state = {step, version, committed_group_ids, data_cursor: {epoch, index}},
                             the trainer's durable state after a restart on either side
    status()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from nano_miles.config import PAUSE_MODES
from nano_miles.wire import SCHEMA_VERSION, WireError, check_count, get, parse_group_id, unpack_message

MAX_ID_CHARS = 128          # req_id, incarnation
MAX_GROUP_IDS = 1 << 20     # ids in one commit or sync: a whole epoch of a large dataset
MAX_RESULT_DEPTH = 8        # nesting of a reply's result


@dataclass(frozen=True)
class ControlRequest:
    cmd: str              # one of COMMANDS
    req_id: str           # 1..MAX_ID_CHARS chars, chosen by the client, the same on every retry
    args: dict[str, Any]  # exactly the arguments COMMANDS[cmd] names, checked


@dataclass(frozen=True)
class ControlReply:
    req_id: str             # the req_id of the request answered
    incarnation: str        # the server process's random id; changes when it restarts
    ok: bool
    result: dict[str, Any]  # JSON-like: str keys; None, bool, int, finite float, str, list, map
    error: str = ""         # what went wrong; non-empty exactly when not ok


def _text_id(value: object, where: str) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_CHARS:
        raise WireError(f"{where}: expected a string of 1..{MAX_ID_CHARS} chars, got {value!r:.60}")
    return value


def _pause_mode(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in PAUSE_MODES:
        raise WireError(f"{where}: {value!r:.60} not in {PAUSE_MODES}")
    return value


def _group_ids(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_GROUP_IDS:
        raise WireError(f"{where}: expected a list of at most {MAX_GROUP_IDS} group ids")
    for i, group_id in enumerate(value):
        parse_group_id(group_id, f"{where}[{i}]")
    if len(set(value)) != len(value):
        seen: set[str] = set()
        dup = next(g for g in value if g in seen or seen.add(g))
        raise WireError(f"{where}: duplicate group id {dup!r}")
    return list(value)


def _sync_state(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected a map, got {type(value).__name__}")
    prefix = where + "."
    cursor = get(value, "data_cursor", dict, prefix)
    return {
        "step": check_count(get(value, "step", int, prefix), prefix + "step"),
        "version": check_count(get(value, "version", int, prefix), prefix + "version"),
        "committed_group_ids": _group_ids(get(value, "committed_group_ids", list, prefix),
                                          prefix + "committed_group_ids"),
        # the next dataset item to issue
        "data_cursor": {k: check_count(get(cursor, k, int, prefix + "data_cursor."), f"{prefix}data_cursor.{k}")
                        for k in ("epoch", "index")},
    }


# Each command's arguments and the check that returns the argument's normalized value.
COMMANDS: dict[str, dict[str, Callable[[object, str], Any]]] = {
    "pause": {"mode": _pause_mode},
    "resume": {"version": check_count},
    "commit": {"step": check_count, "group_ids": _group_ids, "dropped_group_ids": _group_ids},
    "sync": {"state": _sync_state},
    "status": {},
}


def _check_args(cmd: object, args: dict) -> dict[str, Any]:
    if not isinstance(cmd, str) or cmd not in COMMANDS:
        raise WireError(f"cmd: unknown command {cmd!r:.60} (known: {', '.join(COMMANDS)})")
    checked = {}
    for name, check in COMMANDS[cmd].items():
        if name not in args:
            raise WireError(f"args.{name}: missing (required by {cmd})")
        checked[name] = check(args[name], f"args.{name}")
    return checked


def _check_json(value: object, where: str, depth: int = 0) -> None:
    if depth > MAX_RESULT_DEPTH:
        raise WireError(f"{where}: nested deeper than {MAX_RESULT_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise WireError(f"{where}: {value} does not fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise WireError(f"{where}: non-finite value {value}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"{where}: key {key!r:.60} is not a string")
            _check_json(item, f"{where}.{key}", depth + 1)
    else:
        raise WireError(f"{where}: {type(value).__name__} is not JSON-like")


def encode_request(cmd: str, req_id: str, **args: Any) -> bytes:
    """Pack one command, e.g. encode_request("resume", "r7", version=3); unknown arguments are refused."""
    checked = _check_args(cmd, args)
    extra = sorted(args.keys() - checked.keys())
    if extra:
        raise WireError(f"args.{extra[0]}: not an argument of {cmd}")
    m = {"v": SCHEMA_VERSION, "kind": "request", "cmd": cmd, "req_id": _text_id(req_id, "req_id"),
         "args": checked}
    return msgpack.packb(m)


def decode_request(data: bytes | bytearray | memoryview) -> ControlRequest:
    """The ControlRequest in one `kind="request"` message; WireError naming the field otherwise."""
    m = unpack_message(data, ("request",), max_array_items=MAX_GROUP_IDS)
    cmd = get(m, "cmd", str, "")
    req_id = _text_id(get(m, "req_id", str, ""), "req_id")
    return ControlRequest(cmd, req_id, _check_args(cmd, get(m, "args", dict, "")))


def encode_reply(req_id: str, incarnation: str, result: dict[str, Any] | None = None,
                 error: str | None = None) -> bytes:
    """Pack one reply: ok when `error` is None, else a failure carrying `error` (and maybe a result)."""
    if error is not None and (not isinstance(error, str) or not error):
        raise WireError(f"error: expected a non-empty string, got {error!r:.60}")
    result = {} if result is None else result
    if not isinstance(result, dict):
        raise WireError(f"result: expected a map, got {type(result).__name__}")
    _check_json(result, "result")
    m = {"v": SCHEMA_VERSION, "kind": "reply", "req_id": _text_id(req_id, "req_id"),
         "incarnation": _text_id(incarnation, "incarnation"), "ok": error is None,
         "error": error or "", "result": result}
    return msgpack.packb(m)


def decode_reply(data: bytes | bytearray | memoryview) -> ControlReply:
    """The ControlReply in one `kind="reply"` message; WireError naming the field otherwise."""
    m = unpack_message(data, ("reply",), max_array_items=MAX_GROUP_IDS)
    ok = get(m, "ok", bool, "")
    error = get(m, "error", str, "") if "error" in m or not ok else ""
    if ok == bool(error):
        raise WireError(f"error: must be non-empty exactly when ok is false (ok={ok}, error={error!r:.60})")
    result = get(m, "result", dict, "")
    _check_json(result, "result")
    return ControlReply(_text_id(get(m, "req_id", str, ""), "req_id"),
                        _text_id(get(m, "incarnation", str, ""), "incarnation"), ok, result, error)
