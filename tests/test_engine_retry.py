"""The producer retries an engine's 5xx and 429 answers with backoff and still makes the group; a 4xx that
can never succeed is not retried and drops the group for good, with its reason.

A small HTTP proxy in front of a real local engine answers the first /generate calls with scripted
error statuses and passes everything else through, logging every request it sees.
Run: `pytest tests/test_engine_retry.py` (a real local engine on the small policy; ~10 s).
"""

import http.client
import json
import threading
import time
from concurrent.futures import wait
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import zmq

from nano_miles.engine.client import EngineClient, EngineError
from nano_miles.run.config import load_config
from nano_miles.stages.rollout.producer import ENGINE_RETRY_S, RolloutProducer
from nano_miles.tasks import Problem
from nano_miles.wire.data import decode_rollout

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
CUT = 0  # a fault that is no status: the answer's headers promise a body, then the connection closes
WAIT_S = 120.0  # failure bound of every wait below; each returns as soon as its event happens


class FaultyProxy:
    """Passes every request through to the engine, except that the first /generate calls are answered
    with the statuses in `faults`, in order (CUT: cut off mid-answer, as by an engine killed while it
    sends). `calls` logs (monotonic s, method, path, status, prompt)."""

    def __init__(self, engine_url: str, faults: list[int]):
        self.engine = urlsplit(engine_url)
        self.faults = list(faults)
        self.calls: list[tuple[float, str, str, int, list | None]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the engine client expects

            def do_GET(self):
                proxy.handle(self)

            def do_POST(self):
                proxy.handle(self)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        arrived = time.monotonic()
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        prompt = json.loads(body).get("input_ids") if h.path == "/generate" and body else None
        with self.lock:
            fault = self.faults.pop(0) if h.path == "/generate" and self.faults else None
        if fault == CUT:
            with self.lock:
                self.calls.append((arrived, h.command, h.path, CUT, prompt))
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", "4096")
            h.end_headers()
            h.close_connection = True
            return
        if fault is not None:
            status, payload, content_type = fault, json.dumps({"error": {"message": "injected"}}).encode(), \
                "application/json"
        else:
            conn = http.client.HTTPConnection(self.engine.hostname, self.engine.port, timeout=WAIT_S)
            try:
                conn.request(h.command, h.path, body=body or None,
                             headers={"Content-Type": h.headers.get("Content-Type", "application/json")})
                response = conn.getresponse()
                status, payload = response.status, response.read()
                content_type = response.getheader("Content-Type", "application/json")
            finally:
                conn.close()
        with self.lock:
            self.calls.append((arrived, h.command, h.path, status, prompt))
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    def generate_calls(self) -> list[tuple]:
        with self.lock:
            return [c for c in self.calls if c[2] == "/generate"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def producer_behind(proxy: FaultyProxy, tmp_path):
    """A real RolloutProducer whose engine is the proxy, one group per batch, and the PULL end of its
    reward socket; resumed at version 0, the version the engine serves."""
    cfg = load_config(overrides=[f"--engine.port={proxy.port}", f"--reward.endpoint=ipc://{tmp_path}/reward.sock",
                                 f"--rollout.control_endpoint=ipc://{tmp_path}/control.sock",
                                 "--rollout.metrics_port=0", "--rollout.group_size=2", "--rollout.max_new_tokens=4",
                                 "--trainer.batch_groups=1", f"--task.num_train={len(PROMPTS)}"])
    ctx = zmq.Context()
    producer = RolloutProducer(cfg, ctx, [Problem("p", str(i)) for i in range(len(PROMPTS))], PROMPTS,
                               stop_token_ids=[])
    pull = ctx.socket(zmq.PULL)
    pull.bind(cfg.reward.endpoint)
    try:
        producer.control.run_id = "test-run"  # what the trainer's first `restore` sets
        producer.on_resume(0)
        yield producer, pull
    finally:
        pull.close(linger=0)
        producer.close()
        ctx.term()


def issue_one(producer: RolloutProducer) -> None:
    """Issue the one group the gate allows, wait until its generation ended, hand it on."""
    assert producer.may_issue(), producer.on_status()
    producer.issue()
    assert not producer.may_issue(), "the gate should allow one group at a time"
    done, _ = wait(list(producer.state.inflight.values()), timeout=WAIT_S)
    assert len(done) == 1, producer.on_status()
    producer.collect()
    producer.flush_outbox()


def one_group_through(proxy: FaultyProxy, tmp_path) -> tuple:
    """One group made through `proxy`, which is closed after: (proxy, producer, the group, its status)."""
    try:
        with producer_behind(proxy, tmp_path) as (producer, pull):
            issue_one(producer)
            return proxy, producer, receive(pull), producer.on_status()
    finally:
        proxy.close()


def receive(pull: zmq.Socket):
    assert pull.poll(int(WAIT_S * 1000)), "no group reached the reward socket"
    return decode_rollout(pull.recv())


def metric(producer: RolloutProducer, name: str, labels: dict | None = None) -> float:
    return producer.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_5xx_and_429_are_retried_with_backoff_and_the_group_is_made(engine_url, tmp_path):
    assert EngineClient(engine_url).weight_version() == 0  # what the producer waits for after each failure
    faults = [503, 429]
    proxy, producer, group, status = one_group_through(FaultyProxy(engine_url, faults), tmp_path)
    # nothing dropped: the group arrives whole, with every sample finished
    assert group.group_id == "e0-i0" and list(group.prompt_tokens) == PROMPTS[0]
    assert len(group.samples) == 2
    assert all(s.finish_reason in ("length", "stop") and len(s.response_tokens) > 0 for s in group.samples)
    assert status["num_sent"] == 1 and status["dropped_for_good"] == {} and status["num_reissued"] == 0
    # every failure counted, once
    assert status["num_failed"] == len(faults)
    assert metric(producer, "nanomiles_engine_failures_total") == len(faults)
    # attempt, wait for the engine's weights, attempt again: spaced by at least each backoff delay
    calls = [(c[1], c[2], c[3]) for c in proxy.calls]
    assert calls == [("POST", "/generate", 503), ("GET", "/model_info", 200),
                     ("POST", "/generate", 429), ("GET", "/model_info", 200),
                     ("POST", "/generate", 200)], calls
    times = [c[0] for c in proxy.generate_calls()]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(gap >= delay for gap, delay in zip(gaps, ENGINE_RETRY_S)), (gaps, ENGINE_RETRY_S)
    assert [c[4] for c in proxy.generate_calls()] == [[PROMPTS[0]] * 2] * 3  # the same request each time


def test_an_answer_cut_off_by_a_dying_engine_is_retried_and_the_group_is_made(engine_url, tmp_path):
    """An engine killed while it sends an answer leaves the client a short body (IncompleteRead): the
    producer waits it out as it does a refused connection, instead of crashing on it."""
    proxy, _, group, status = one_group_through(FaultyProxy(engine_url, [CUT]), tmp_path)
    assert group.group_id == "e0-i0" and len(group.samples) == 2
    assert status["num_sent"] == 1 and status["num_failed"] == 1 and status["dropped_for_good"] == {}
    calls = [(c[1], c[2], c[3]) for c in proxy.calls]
    assert calls == [("POST", "/generate", CUT), ("GET", "/model_info", 200), ("POST", "/generate", 200)], calls


def test_a_permanent_4xx_is_not_retried_and_drops_the_group_for_good(engine_url, tmp_path):
    proxy = FaultyProxy(engine_url, [400])
    try:
        with producer_behind(proxy, tmp_path) as (producer, pull):
            issue_one(producer)  # e0-i0: refused, dropped for good; its slot goes to the next prompt
            issue_one(producer)  # e0-i1
            group = receive(pull)
            status = producer.on_status()
    finally:
        proxy.close()
    assert status["dropped_for_good"] == {"e0-i0": "engine_http_400"}
    assert status["num_failed"] == 1 and status["num_reissued"] == 0
    assert metric(producer, "nanomiles_dropped_for_good_groups_total", {"reason": "engine_http_400"}) == 1
    # one attempt only, and no wait for the engine's weights after it
    calls = [(c[1], c[2], c[3], c[4]) for c in proxy.calls]
    assert calls == [("POST", "/generate", 400, [PROMPTS[0]] * 2),
                     ("POST", "/generate", 200, [PROMPTS[1]] * 2)], calls
    assert group.group_id == "e0-i1" and status["num_sent"] == 1
    assert status["outstanding_group_ids"] == ["e0-i1"]


def test_the_trainer_does_not_wait_out_a_refused_request_and_an_empty_batch_is_never_sent(engine_url, tmp_path):
    """The trainer's calls to the engine (`Peers.with_engine`) wait out an engine that is down, never
    a 4xx: the same request would be refused again. An empty batch is refused before it is sent."""
    from nano_miles.stages.trainer.peers import Peers

    proxy = FaultyProxy(engine_url, [400])
    cfg = load_config(overrides=[f"--engine.port={proxy.port}", f"--rollout.control_endpoint=ipc://{tmp_path}/c"])
    ctx = zmq.Context()
    peers = Peers(cfg, ctx, durable_state=lambda: None, run_id="test-run")
    greedy = {"max_new_tokens": 2, "temperature": 0.0}
    try:
        with pytest.raises(EngineError, match="HTTP 400"):
            peers.with_engine("evaluation", lambda: peers.engine.generate(PROMPTS, greedy, return_logprob=False))
        for empty in ([], [[]], [PROMPTS[0], []]):
            with pytest.raises(ValueError, match="at least one prompt"):
                peers.engine.generate(empty, greedy)
        calls = [(c[1], c[2], c[3]) for c in proxy.calls]
    finally:
        proxy.close()
        peers.control.close()
        ctx.term()
    assert calls == [("POST", "/generate", 400)], calls  # one attempt, no wait for the engine, nothing empty


def test_only_a_refused_generation_request_counts_as_permanent():
    """A weight update the engine failed answers 4xx too, and is tried again (with a rebuilt
    transport): only /generate's 4xx is the request's fault."""
    from nano_miles.engine.client import is_permanent
    assert is_permanent(EngineError(400, "prompt too long", "/generate"))
    assert not is_permanent(EngineError(429, "busy", "/generate"))
    assert not is_permanent(EngineError(503, "starting", "/generate"))
    assert not is_permanent(EngineError(400, "Failed to update weights", "/update_weights_from_distributed"))
    assert not is_permanent(OSError("connection refused"))
