"""Fuzz of everything that reads bytes from a socket: the four decoders and the control endpoint.

Run: `pytest tests/test_fuzz.py` (~30 s). Over 10,000 malformed inputs, derandomized so that CI sees
the same ones every time. Each input must be rejected with a reason that names the field (WireError)
or, at the control endpoint, answered ok=false with an error; the rare mutation that is still a valid
message must re-encode and decode back equal. Nothing may raise anything else.
"""

import re
import threading

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_wire import edit_at, golden_messages, paths, raw

from nano_miles.wire.codec import WireError
from nano_miles.wire.control import (COMMANDS, CONTROL_SCHEMA_VERSION, decode_reply, decode_request, encode_reply,
                                     encode_request)
from nano_miles.wire.data import decode_rollout, decode_scored, encode_rollout, encode_scored
from nano_miles.wire.sockets import ControlServer, make_socket

# the first name of every field a WireError can point at
FIELDS = ("message", "v", "kind", "cmd", "req_id", "run_id", "args", "incarnation", "ok", "error", "result",
          "group_id", "attempt", "prompt_tokens", "samples", "metadata", "timestamps", "rewards",
          "advantages", "reward_parts", "group")
NAMES_A_FIELD = re.compile(rf"^({'|'.join(FIELDS)})([.\[:]|\s)")

REENCODERS = {
    decode_rollout: encode_rollout, decode_scored: encode_scored,
    decode_request: lambda r: encode_request(r.cmd, r.req_id, r.run_id, **r.args),
    decode_reply: lambda r: encode_reply(r.req_id, r.incarnation, r.result, r.error or None),
}
COUNTS = {"inputs": 0, "rejected": 0, "valid": 0}


def check_decoders(data) -> None:
    COUNTS["inputs"] += 1
    for decode, encode in REENCODERS.items():
        try:
            message = decode(data)
        except WireError as e:
            assert NAMES_A_FIELD.match(str(e)), f"{decode.__name__}: reason names no field: {e}"
            COUNTS["rejected"] += 1
            continue
        COUNTS["valid"] += 1
        assert decode(encode(message)) == message


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=8), st.binary(max_size=24),
                    st.sampled_from(["e0-i1", "stop", "rollout", "scored", "request", "reply", "status"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)
FUZZ = settings(derandomize=True, deadline=None, database=None, max_examples=2500,
                suppress_health_check=list(HealthCheck))


@st.composite
def mutated(draw):
    """A golden message truncated, bit-flipped, with one field replaced or deleted, or a field added."""
    message = draw(st.sampled_from(sorted(golden_messages().values())))
    how = draw(st.sampled_from(["truncate", "flip", "replace", "delete", "wrong_kind"]))
    if how == "truncate":
        return message[:draw(st.integers(0, len(message) - 1))]
    if how == "flip":
        buf = bytearray(message)
        for i in draw(st.lists(st.integers(0, len(buf) - 1), min_size=1, max_size=4)):
            buf[i] ^= draw(st.integers(1, 255))
        return bytes(buf)
    m = raw(message)
    if how == "wrong_kind":
        m["kind"] = draw(st.sampled_from(["rollout", "scored", "request", "reply", "x"]))
        return msgpack.packb(m)
    path = draw(st.sampled_from(list(paths(m))))
    return msgpack.packb(edit_at(m, path, how, draw(values)))


@st.composite
def requests(draw):
    """Well-framed control requests with wrong arguments: past the framing checks, into the commands."""
    cmd = draw(st.one_of(st.sampled_from(sorted(COMMANDS)), st.text(max_size=8)))
    args = draw(st.dictionaries(st.sampled_from(["mode", "version", "step", "group_ids", "dropped_attempts", "no_signal_group_ids",
                                                 "state", "x"]), values, max_size=3))
    req_id = draw(st.one_of(st.text(min_size=1, max_size=12), values))
    return msgpack.packb({"v": CONTROL_SCHEMA_VERSION, "kind": "request", "cmd": cmd, "req_id": req_id, "args": args})


@FUZZ
@given(st.binary(max_size=96))
def test_decoders_random_bytes(data):
    check_decoders(data)


@FUZZ
@given(values)
def test_decoders_random_msgpack(value):
    check_decoders(msgpack.packb(value))


@FUZZ
@given(mutated())
def test_decoders_mutated_messages(data):
    check_decoders(data)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ctx = zmq.Context()
    handlers = {"pause": lambda mode: {"paused": True}, "resume": lambda version: {"version": version},
                "commit": lambda step, group_ids, dropped_attempts, no_signal_group_ids: {"step": step},
                "restore": lambda state: {}, "status": lambda: {"waiting_for": "nothing"}}
    srv = ControlServer(ctx, f"ipc://{tmp_path_factory.mktemp('control')}/control.sock", handlers)
    yield srv
    srv.close()
    ctx.term()


def check_answer(srv: ControlServer, data: bytes) -> None:
    """The control endpoint answers every input; an undecodable request gets ok=false and why."""
    COUNTS["inputs"] += 1
    reply = decode_reply(srv._answer(data))
    try:
        decode_request(data)
    except WireError:
        assert not reply.ok and reply.error.startswith("bad request: ") and NAMES_A_FIELD.match(reply.error[13:])
        COUNTS["rejected"] += 1
        return
    COUNTS["valid"] += 1


@FUZZ
@given(st.one_of(requests(), mutated(), st.binary(max_size=64)))
def test_control_endpoint_answers_everything(server, data):
    check_answer(server, data)


@settings(FUZZ, max_examples=300)
@given(st.one_of(requests(), mutated()))
def test_control_rep_socket_survives(server, data):
    """The same inputs through a real REQ/REP pair: one reply each, the server never stops serving."""
    served = threading.Thread(target=server.poll_once, args=(5.0,))
    served.start()
    client = make_socket(zmq.Context.instance(), zmq.REQ, server.sock.getsockopt_string(zmq.LAST_ENDPOINT),
                         bind=False, recv_timeout_ms=5000)
    try:
        client.send(data)
        reply = decode_reply(client.recv())
    finally:
        client.close(linger=0)
        served.join()
    COUNTS["inputs"] += 1
    try:
        decode_request(data)
        COUNTS["valid"] += 1
    except WireError:
        assert not reply.ok and reply.error
        COUNTS["rejected"] += 1


def test_fuzz_volume():
    """Runs last in this file: the total number of inputs tried above (skipped when run alone)."""
    if COUNTS["inputs"] == 0:
        pytest.skip("the fuzz tests of this file did not run")
    print(COUNTS)
    assert COUNTS["inputs"] >= 10_000, COUNTS
    assert COUNTS["rejected"] > 0.9 * (COUNTS["rejected"] + COUNTS["valid"]), COUNTS
