"""Control-plane messages of nano-miles: the trainer's REQ commands and the rollout producer's REP replies.

Test: `pytest tests/test_wire.py`. Framing, limits and WireError are those of `codec.py`; control messages
carry schema version `v` = CONTROL_SCHEMA_VERSION (3: every request names its run; `restore` carries the
token count goodput divides by; 4: `commit` and `restore` carry the groups consumed without signal;
5: `commit` names the attempt of each refused copy).

Every request carries the `run_id` of the trainer's run (kept in its checkpoints). A producer takes the
run of the first `restore` it is sent and refuses requests of any other run, so a leftover trainer of an
earlier run, or a second run on the same ports, is turned away instead of mixed in.

Every request also carries a `req_id` that the client keeps across retries (Lazy Pirate), so a server that
already executed that request answers again without doing it twice. Every reply carries the server's
`incarnation`, a random id drawn at process start: a new value tells the client the server restarted
and lost its state, so the client re-sends `restore`.

Commands (arguments after the name; decoders refuse unknown commands and bad arguments, and ignore
unknown argument keys like unknown keys anywhere else):
    pause(mode)              mode in PAUSE_MODES, the engine's pause mode: "abort" ends in-flight
                             requests (their groups are re-issued), "retract" frees their KV cache and
                             re-prefills them after resume, "in_place" keeps them where they are
    resume(version)          version >= 0: the weight version the engine now serves
    commit(step, group_ids, dropped_attempts, no_signal_group_ids)
                             step >= 0: the steps now in the trainer's model (the version gate
                             counts them); group_ids: the groups trained at that step (now in the
                             trainer's model); dropped_attempts: group id -> attempt of the copy the
                             trainer refused since its last commit (stale, from weights it no longer
                             has): issue the group again unless a later copy is already on its way;
                             no_signal_group_ids: groups it consumed without training since its last
                             commit (trainer.skip_zero_variance: all rewards equal): never issue them again
    restore(state)           state: a RestoreState {step, version, committed_group_ids, cursor,
                             num_generated_tokens, no_signal_group_ids}, the trainer's durable state after a restart on
                             either side; cursor = one past the furthest dataset position (group id)
                             the trainer has trained
    status()

Every command is answered with the producer's `ProducerStatus` (its fields are checked on both ends).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import msgpack

from nano_miles.algo.admission import NO_SIGNAL  # a reason the ledger and the status carry
from nano_miles.wire.codec import WireError, check_count, check_text_id, get, parse_group_id, unpack_message

CONTROL_SCHEMA_VERSION = 5

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes

MAX_GROUP_IDS = 1 << 20     # ids in one commit, restore or status: a whole epoch of a large dataset
MAX_RESULT_DEPTH = 8        # nesting of a reply's result


@dataclass(frozen=True)
class ControlRequest:
    cmd: str              # one of COMMANDS
    req_id: str           # 1..MAX_ID_CHARS chars, chosen by the client, the same on every retry
    args: dict[str, Any]  # exactly the arguments COMMANDS[cmd] names, checked
    run_id: str           # 1..MAX_ID_CHARS chars: the run of the trainer that sends it


@dataclass(frozen=True)
class ControlReply:
    req_id: str             # the req_id of the request answered
    incarnation: str        # the server process's random id; changes when it restarts
    ok: bool
    result: dict[str, Any]  # JSON-like: str keys; None, bool, int, finite float, str, list, map
    error: str = ""         # what went wrong; non-empty exactly when not ok


@dataclass(frozen=True)
class ProducerStatus:
    """The rollout producer's state: the result of every control command."""

    version: int                  # weight version the engine serves, as the producer was told; -1 = not yet
    is_paused: bool
    waiting_for: str              # what the producer's loop is waiting for, in words
    num_sent: int                 # groups sent on to reward (this incarnation)
    num_generated_tokens: int     # response tokens of those groups (goodput's denominator)
    num_resumed_samples: int      # sample segments resumed after an abort-mode pause
    num_failed: int               # engine failures (each retried)
    num_reissued: int             # groups put back in line (lease expired, dropped, rolled back)
    num_inflight: int             # groups being generated now
    outstanding_group_ids: list[str]   # issued, not yet trained or dropped (inflight ones included)
    dropped_for_good: dict[str, str]   # group id -> why the producer gave up on it; no_signal groups only in
                                       # the reply to restore (the trainer decided those and keeps them)

    @property
    def num_outstanding(self) -> int:
        return len(self.outstanding_group_ids)

    def to_result(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_result(cls, result: dict[str, Any], where: str = "result") -> "ProducerStatus":
        """The status in a reply's result; WireError naming the field when one is missing or wrong."""
        prefix = where + "."
        version = get(result, "version", int, prefix)
        if version < -1:
            raise WireError(f"{prefix}version: expected an int >= -1, got {version}")
        counts = {f: check_count(get(result, f, int, prefix), prefix + f) for f in
                  ("num_sent", "num_generated_tokens", "num_resumed_samples", "num_failed", "num_reissued",
                   "num_inflight")}
        dropped = get(result, "dropped_for_good", dict, prefix)
        for group_id, reason in dropped.items():
            parse_group_id(group_id, f"{prefix}dropped_for_good")
            if not isinstance(reason, str):
                raise WireError(f"{prefix}dropped_for_good.{group_id}: expected str")
        return cls(version=version, is_paused=get(result, "is_paused", bool, prefix),
                   waiting_for=get(result, "waiting_for", str, prefix), **counts,
                   outstanding_group_ids=_group_ids(get(result, "outstanding_group_ids", list, prefix),
                                                    prefix + "outstanding_group_ids"),
                   dropped_for_good=dict(dropped))


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


def _attempts(value: object, where: str) -> dict[str, int]:
    """A map of group id -> attempt (a count)."""
    if not isinstance(value, dict) or len(value) > MAX_GROUP_IDS:
        raise WireError(f"{where}: expected a map of at most {MAX_GROUP_IDS} group ids to attempts")
    for group_id, attempt in value.items():
        parse_group_id(group_id, f"{where} key")
        check_count(attempt, f"{where}.{group_id}")
    return dict(value)


@dataclass(frozen=True)
class RestoreState:
    """The trainer's durable state, which `restore` hands to a (re)started producer."""

    step: int                         # optimizer steps in the trainer's model
    version: int                      # weight version the engine serves (= step)
    committed_group_ids: list[str]    # every group in the trainer's model
    cursor: int                       # one past the furthest dataset position the trainer has trained
    num_generated_tokens: int = 0     # the producer's token count as the trainer last heard it: a
                                      # restarted producer counts on from it (goodput spans restarts)
    no_signal_group_ids: list[str] = field(default_factory=list)  # consumed untrained: never issue again


def _restore_state(value: object, where: str) -> RestoreState:
    if isinstance(value, RestoreState):
        value = asdict(value)
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected a map, got {type(value).__name__}")
    prefix = where + "."
    return RestoreState(
        step=check_count(get(value, "step", int, prefix), prefix + "step"),
        version=check_count(get(value, "version", int, prefix), prefix + "version"),
        committed_group_ids=_group_ids(get(value, "committed_group_ids", list, prefix),
                                       prefix + "committed_group_ids"),
        cursor=check_count(get(value, "cursor", int, prefix), prefix + "cursor"),
        num_generated_tokens=check_count(get(value, "num_generated_tokens", int, prefix),
                                         prefix + "num_generated_tokens"),
        no_signal_group_ids=_group_ids(get(value, "no_signal_group_ids", list, prefix),
                                       prefix + "no_signal_group_ids"))


# Each command's arguments and the check that returns the argument's normalized value.
COMMANDS: dict[str, dict[str, Callable[[object, str], Any]]] = {
    "pause": {"mode": _pause_mode},
    "resume": {"version": check_count},
    "commit": {"step": check_count, "group_ids": _group_ids, "dropped_attempts": _attempts,
               "no_signal_group_ids": _group_ids},
    "restore": {"state": _restore_state},
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


def encode_request(cmd: str, req_id: str, run_id: str, **args: Any) -> bytes:
    """Pack one command, e.g. encode_request("resume", "r7", "run-1", version=3); unknown arguments are
    refused."""
    checked = _check_args(cmd, args)
    extra = sorted(args.keys() - checked.keys())
    if extra:
        raise WireError(f"args.{extra[0]}: not an argument of {cmd}")
    m = {"v": CONTROL_SCHEMA_VERSION, "kind": "request", "cmd": cmd, "req_id": check_text_id(req_id, "req_id"),
         "run_id": check_text_id(run_id, "run_id"),
         "args": {k: asdict(v) if isinstance(v, RestoreState) else v for k, v in checked.items()}}
    return msgpack.packb(m)


def decode_request(data: bytes | bytearray | memoryview) -> ControlRequest:
    """The ControlRequest in one `kind="request"` message; WireError naming the field otherwise."""
    # a commit names its refused copies in a map keyed by id: bounded like the id lists
    m = unpack_message(data, ("request",), max_array_items=MAX_GROUP_IDS, max_map_items=MAX_GROUP_IDS,
                       versions=(CONTROL_SCHEMA_VERSION,))
    cmd = get(m, "cmd", str, "")
    req_id = check_text_id(get(m, "req_id", str, ""), "req_id")
    run_id = check_text_id(get(m, "run_id", str, ""), "run_id")
    return ControlRequest(cmd, req_id, _check_args(cmd, get(m, "args", dict, "")), run_id)


def encode_reply(req_id: str, incarnation: str, result: dict[str, Any] | None = None,
                 error: str | None = None) -> bytes:
    """Pack one reply: ok when `error` is None, else a failure carrying `error` (and maybe a result)."""
    if error is not None and (not isinstance(error, str) or not error):
        raise WireError(f"error: expected a non-empty string, got {error!r:.60}")
    result = {} if result is None else result
    if not isinstance(result, dict):
        raise WireError(f"result: expected a map, got {type(result).__name__}")
    _check_json(result, "result")
    m = {"v": CONTROL_SCHEMA_VERSION, "kind": "reply", "req_id": check_text_id(req_id, "req_id"),
         "incarnation": check_text_id(incarnation, "incarnation"), "ok": error is None,
         "error": error or "", "result": result}
    return msgpack.packb(m)


def decode_reply(data: bytes | bytearray | memoryview) -> ControlReply:
    """The ControlReply in one `kind="reply"` message; WireError naming the field otherwise."""
    # a status names its dropped groups in a map keyed by id: bounded like the id lists
    m = unpack_message(data, ("reply",), max_array_items=MAX_GROUP_IDS, max_map_items=MAX_GROUP_IDS,
                       versions=(CONTROL_SCHEMA_VERSION,))
    ok = get(m, "ok", bool, "")
    error = get(m, "error", str, "") if "error" in m or not ok else ""
    if ok == bool(error):
        raise WireError(f"error: must be non-empty exactly when ok is false (ok={ok}, error={error!r:.60})")
    result = get(m, "result", dict, "")
    _check_json(result, "result")
    return ControlReply(check_text_id(get(m, "req_id", str, ""), "req_id"),
                        check_text_id(get(m, "incarnation", str, ""), "incarnation"), ok, result, error)
