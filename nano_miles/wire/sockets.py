"""ZeroMQ plumbing: the one socket factory, the Lazy Pirate control client and the control server.

Library module; `tests/test_sockets.py` exercises it over real sockets.

Stable stages bind (reward's and trainer's PULL, the producer's REP); the others connect, so any
stage can restart without the others reconfiguring. HWM only caps memory: flow control and staleness
are application logic in the rollout producer.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from typing import Any, Callable
from urllib.parse import urlparse

import zmq

from nano_miles.wire.codec import WireError
from nano_miles.wire.control import decode_reply, decode_request, encode_reply, encode_request

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
CURVE = {"key_dir": ""}        # set once per process by use_curve(); "" = plain sockets
_authenticators: dict[int, object] = {}  # one ZAP authenticator per context that binds


def use_curve(key_dir: str) -> None:
    """Every socket made from now on uses CURVE with the keys of `python -m nano_miles.run.keys key_dir`."""
    CURVE["key_dir"] = key_dir


def _apply_curve(ctx: zmq.Context, sock: zmq.Socket, bind: bool) -> None:
    from pathlib import Path

    import zmq.auth
    key_dir = Path(CURVE["key_dir"])
    if bind:
        if id(ctx) not in _authenticators:  # admit only the client keys listed in allowed/
            from zmq.auth.thread import ThreadAuthenticator
            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve(domain="*", location=str(key_dir / "allowed"))
            _authenticators[id(ctx)] = auth
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(key_dir / "server.key_secret")
        sock.curve_server = True
    else:
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(key_dir / "client.key_secret")
        sock.curve_serverkey, _ = zmq.auth.load_certificate(key_dir / "server.key")


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool, hwm_msgs: int = 1000,
                linger_ms: int = 0, recv_timeout_ms: int = -1, send_timeout_ms: int = -1) -> zmq.Socket:
    """A socket with HWM, LINGER and timeouts set before it binds or connects.

    LINGER defaults to 0: a stage that exits must not hang on unsent messages; anything lost that
    way is re-issued by the ledger, never waited for.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, hwm_msgs)
    sock.setsockopt(zmq.RCVHWM, hwm_msgs)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.RCVTIMEO, recv_timeout_ms)
    sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
    if CURVE["key_dir"]:
        _apply_curve(ctx, sock, bind)
    if bind:
        host = urlparse(endpoint).hostname if endpoint.startswith("tcp://") else None
        if host is not None and host not in LOOPBACK_HOSTS:
            log.warning("binding %s beyond loopback: anyone who reaches it can send messages", endpoint)
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class ControlTimeout(RuntimeError):
    """The control server did not answer after every retry."""


class ControlError(RuntimeError):
    """The control server answered with ok=false."""


class ControlClient:
    """REQ side of the control channel, Lazy Pirate style (zguide ch. 4).

    A REQ socket that timed out is stuck in its send/recv cycle, so each retry closes it and opens a
    fresh one. The req_id stays the same across retries; the server answers a repeated req_id from its
    reply cache, so a retried command is never executed twice. `give_up` is asked after every try that
    timed out: true ends the retries at once (the client's process is stopping; the server may be too).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, *, run_id: str, timeout_s: float = 5.0, retries: int = 6,
                 give_up: Callable[[], bool] = lambda: False):
        self.ctx, self.endpoint, self.timeout_s, self.retries = ctx, endpoint, timeout_s, retries
        self.give_up = give_up
        self.run_id = run_id  # sent with every request; the server refuses any other run
        self.sock: zmq.Socket | None = None
        self.server_incarnation: str | None = None
        self.is_server_restarted = False  # set when the incarnation changes; the caller re-syncs

    def _fresh_socket(self) -> zmq.Socket:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = make_socket(self.ctx, zmq.REQ, self.endpoint, bind=False)
        return self.sock

    def request(self, cmd: str, **args: Any) -> dict[str, Any]:
        req_id = uuid.uuid4().hex
        payload = encode_request(cmd, req_id, self.run_id, **args)
        for attempt in range(1, self.retries + 1):
            sock = self.sock or self._fresh_socket()
            sock.send(payload)
            if sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                reply = decode_reply(sock.recv())
                if reply.req_id != req_id:  # a late answer to an abandoned request: REQ cannot get one
                    raise ControlError(f"{cmd}: reply for {reply.req_id}, expected {req_id}")
                self._note_incarnation(reply.incarnation)
                if not reply.ok:
                    raise ControlError(f"{cmd} refused by {self.endpoint}: {reply.error}")
                return reply.result
            log.warning("control %s: no reply from %s within %.1fs (try %d/%d)", cmd, self.endpoint,
                        self.timeout_s, attempt, self.retries)
            self._fresh_socket()
            if self.give_up():
                break
        raise ControlTimeout(f"control {cmd}: {self.endpoint} did not answer in {attempt} tries "
                             f"of {self.timeout_s}s")

    def _note_incarnation(self, incarnation: str) -> None:
        if self.server_incarnation is not None and incarnation != self.server_incarnation:
            log.warning("control server %s restarted (incarnation %s -> %s)", self.endpoint,
                        self.server_incarnation, incarnation)
            self.is_server_restarted = True
        self.server_incarnation = incarnation

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None


class ControlServer:
    """REP side: decodes a request, runs its handler, replies; answers repeats from a reply cache.

    Every received message gets exactly one reply (REP requires it): undecodable requests, unknown
    commands and requests of another run are answered with ok=false and a reason, and counted. The
    server belongs to no run until a `claim_cmd` request arrives; from then on, to that request's run.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str,
                 handlers: dict[str, Callable[..., dict[str, Any]]], *, claim_cmd: str = "restore",
                 max_cached_replies: int = 256):
        self.sock = make_socket(ctx, zmq.REP, endpoint, bind=True)
        self.handlers = handlers
        self.claim_cmd = claim_cmd
        self.run_id: str | None = None  # the run this server serves, once claimed
        self.incarnation = uuid.uuid4().hex[:16]
        self.replies: OrderedDict[str, bytes] = OrderedDict()
        self.max_cached_replies = max_cached_replies
        self.num_rejected = 0
        self.num_foreign = 0            # well-formed requests of another run, refused

    def poll_once(self, timeout_s: float) -> bool:
        """Serve at most one request; returns whether one was served."""
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return False
        self.sock.send(self._answer(self.sock.recv()))
        return True

    def _answer(self, data: bytes) -> bytes:
        try:
            req = decode_request(data)
        except WireError as e:
            self.num_rejected += 1
            log.warning("control: rejected a request: %s", e)
            return encode_reply("invalid", self.incarnation, error=f"bad request: {e}")
        if self.run_id is not None and req.run_id != self.run_id:
            self.num_foreign += 1
            log.warning("control: refused %s from run %s (this server serves run %s)", req.cmd, req.run_id,
                        self.run_id)
            return encode_reply(req.req_id, self.incarnation,
                                error=f"foreign run: {req.run_id} (this server serves run {self.run_id})")
        if req.req_id in self.replies:
            return self.replies[req.req_id]
        if req.cmd == self.claim_cmd:
            self.run_id = req.run_id
        handler = self.handlers.get(req.cmd)
        if handler is None:
            return encode_reply(req.req_id, self.incarnation, error=f"{req.cmd} is not served here")
        try:
            reply = encode_reply(req.req_id, self.incarnation, handler(**req.args))
        except (ValueError, RuntimeError) as e:  # a handler refusing a valid-looking command
            reply = encode_reply(req.req_id, self.incarnation, error=f"{type(e).__name__}: {e}")
        self.replies[req.req_id] = reply
        while len(self.replies) > self.max_cached_replies:
            self.replies.popitem(last=False)
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)
