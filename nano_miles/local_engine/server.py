"""HTTP layer of the local engine: SGLang's native routes over stdlib http.server.
Run: python -m nano_miles.local_engine --model-path DIR [--host 127.0.0.1] [--port 30000]

Handler threads parse and validate; the scheduler thread owns the model. Status codes follow
docs/sglang-contract.md §1: 400 `{"error": {"message"}}` for a bad /generate, the OpenAI-style
error envelope for bad control requests, `{"success": false, ...}` 400 for a failed weight update,
404 and 405 as FastAPI answers them. Every request's body is read and parsed in `_dispatch`; a body
it will not read (chunked or without Content-Length: 411; over MAX_BODY_BYTES: 413) is refused in
the route's envelope and ends the connection.
"""

import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

from nano_miles.local_engine import ENGINE_VERSION
from nano_miles.local_engine.protocol import generate_response, parse_generate, parse_json_body
from nano_miles.local_engine.sampling import SamplingParams
from nano_miles.local_engine.scheduler import Request, Scheduler, SchedulerStopped, StepBoundaryTimeout
from nano_miles.local_engine.weight_group import WeightGroups
from nano_miles.observe.metrics import EngineMetrics
from nano_miles.weights.broadcast_group import WeightTransportError
from nano_miles.weights.named_tensors import WeightUpdateError, copy_planned, plan_copy, read_safetensors_dir
from nano_miles.weights.tensor_receiver import keep_mapped, read_weight_update
from nano_miles.wire.control import PAUSE_MODES

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 300.0  # a control command waits at most this long for a step boundary
PAUSE_ABORT_TIMEOUT_S = 30.0  # pause(abort) waits this long for aborted requests to be answered
HEALTH_GENERATE_TIMEOUT_S = 20.0  # same budget as SGLang's health check
# The largest legitimate body is a /generate batch: a full decode batch (--max-running-requests, 256
# by default) of 32k-token prompts at up to 8 bytes a token id in JSON ("151935, ") is 64 MiB. Weight
# updates carry handles, never tensor data (~220 bytes a tensor), or names and shapes.
MAX_BODY_BYTES = 64 << 20
# Each read or write on a connection gives up after this long, so a client that sends its headers and
# stalls holds a handler thread for seconds, not forever. No live client on this host or the LAN pauses
# that long inside a request. It also closes a keep-alive connection idle that long, as uvicorn under
# SGLang does (its default is 5 s); EngineClient then reopens it.
SOCKET_TIMEOUT_S = 5.0


@dataclass
class EngineState:
    scheduler: Scheduler
    model_path: str
    model_type: str
    architectures: list[str]
    vocab_size: int
    context_len: int
    device: str
    dtype: str
    host: str
    port: int
    metrics: EngineMetrics  # Prometheus metrics served on GET /metrics
    weight_groups: WeightGroups | None = None  # process groups joined for distributed weight updates

    def __post_init__(self):
        self.weight_groups = self.weight_groups or WeightGroups(self.device)


class RequestRefused(Exception):
    """A request refused on its framing, before its body is read; `status` is the HTTP answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client connection must not block shutdown
    allow_reuse_address = True
    request_queue_size = 1024  # listen backlog: a rollout burst opens hundreds of connections at once

    def __init__(self, state: EngineState):
        self.state = state
        super().__init__((state.host, state.port), EngineHandler)

    def handle_error(self, request, client_address) -> None:
        """Every exception a handler lets out lands here: a client that hung up mid-request or
        mid-response is one line, anything else keeps socketserver's traceback."""
        error = sys.exception()
        if isinstance(error, ConnectionError):  # reset, broken pipe, aborted
            log.info("client %s went away: %s", client_address[0], error)
        else:
            super().handle_error(request, client_address)


class EngineHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes; with Nagle on, a keep-alive client's delayed ACK
    # holds the body back ~40 ms on every call.
    disable_nagle_algorithm = True
    timeout = SOCKET_TIMEOUT_S  # set on the socket; a timeout ends the connection (http.server logs it at debug)
    server: EngineHTTPServer
    body: dict  # the request's JSON object, `{}` when it has no body

    # ---- plumbing ----
    def log_message(self, format, *args):  # one line per request only at debug level
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _error(self, status: int, message: str, headers: dict | None = None) -> None:
        if self._route_path == "/generate":
            self._json(status, {"error": {"message": message}}, headers)
        else:
            self._json(status, {"object": "error", "message": message, "type": HTTPStatus(status).phrase,
                                "param": None, "code": status}, headers)

    def _read_body(self) -> bytes:
        """The raw body, read only once its framing is sane; RequestRefused if it is not."""
        if "Transfer-Encoding" in self.headers:  # http.server does not decode chunked bodies
            raise RequestRefused(411, "chunked request bodies are not supported: send a Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            if self.command in ("POST", "PUT"):
                raise RequestRefused(411, f"{self.command} needs a Content-Length header (send {{}} for no body)")
            return b""
        if not (length.isascii() and length.isdigit()):
            raise RequestRefused(400, f"invalid Content-Length {length!r}")
        if int(length) > MAX_BODY_BYTES:
            raise RequestRefused(413, f"a body of {int(length)} bytes is over the limit of {MAX_BODY_BYTES} bytes")
        return self.rfile.read(int(length))

    def _dispatch(self) -> None:
        """Every request passes here: the body is read and parsed in this one place, then routed."""
        self._route_path = urlsplit(self.path).path
        try:  # read also for an unknown route, so that a keep-alive connection stays usable
            raw = self._read_body()
        except RequestRefused as e:  # the body stays unread: the connection cannot carry another request
            self._error(e.status, str(e), {"Connection": "close"})
            return
        handler = ROUTES.get((self.command, self._route_path))
        if handler is None:  # FastAPI's answers, as SGLang gives them
            allowed = sorted(method for method, path in ROUTES if path == self._route_path)
            if allowed:
                self._json(405, {"detail": "Method Not Allowed"}, {"Allow": ", ".join(allowed)})
            else:
                self._json(404, {"detail": "Not Found"})
            return
        try:
            self.body = parse_json_body(raw)
            handler(self)
        except ValueError as e:  # validation: the client's fault
            self._error(400, str(e))
        except (SchedulerStopped, StepBoundaryTimeout) as e:  # not a socket timeout: http.server ends that connection
            self._error(503, str(e))

    # DELETE and PATCH too: a known route called with them gets 405, not http.server's 501
    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch

    # ---- routes ----
    def generate(self):
        state = self.server.state
        reqs, is_batch = parse_generate(self.body, state.vocab_size, state.context_len)
        state.scheduler.submit(reqs)
        try:
            for r in reqs:
                state.scheduler.wait(r)
            outputs = [generate_response(r) for r in reqs]
            state.metrics.count_generated(reqs)
            state.scheduler.retire(reqs)
            self._json(200, outputs if is_batch else outputs[0])
        finally:
            state.scheduler.release(reqs)

    def health(self):
        self._send(200 if self.server.state.scheduler.is_alive else 503, b"", "text/plain")

    def health_generate(self):
        scheduler = self.server.state.scheduler
        if scheduler.is_paused:  # SGLang would block (then 503 after 20 s); answer at once instead
            self._send(503, b"generation is paused", "text/plain")
            return
        r = Request(rid=f"health-{uuid.uuid4().hex}", input_ids=[0], params=SamplingParams(max_new_tokens=1))
        scheduler.submit([r])
        try:
            is_ok = r.done.wait(timeout=HEALTH_GENERATE_TIMEOUT_S) and r.finish_reason["type"] != "abort"
        finally:
            scheduler.release([r])
        self._send(200 if is_ok else 503, b"", "text/plain")

    def model_info(self):
        state = self.server.state
        self._json(200, {"model_path": state.model_path, "tokenizer_path": None, "is_generation": True,
                         "preferred_sampling_params": None, "weight_version": state.scheduler.weight_version,
                         "has_image_understanding": False, "has_audio_understanding": False,
                         "model_type": state.model_type, "architectures": state.architectures})

    def server_info(self):
        state = self.server.state
        self._json(200, {"version": ENGINE_VERSION, "weight_version": state.scheduler.weight_version,
                         "model_path": state.model_path, "host": state.host, "port": state.port,
                         "device": state.device, "dtype": state.dtype, "context_length": state.context_len,
                         "max_running_requests": state.scheduler.max_running_requests,
                         "skip_tokenizer_init": True, "disable_radix_cache": True,  # no prefix cache
                         "internal_states": [state.scheduler.stats()]})

    def metrics(self):
        self._send(200, self.server.state.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")

    def flush_cache(self):
        # no prefix cache to flush: every request prefills from scratch
        self._send(200, b"Cache flushed.\n", "text/plain")

    def pause_generation(self):
        mode = self.body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        scheduler = self.server.state.scheduler
        aborted = scheduler.run_in_loop(lambda: scheduler.pause(mode), CONTROL_TIMEOUT_S)
        # abort: like SGLang, return only once every aborted /generate has been answered
        deadline = time.monotonic() + PAUSE_ABORT_TIMEOUT_S
        num_unanswered = sum(not r.responded.wait(max(0.0, deadline - time.monotonic())) for r in aborted)
        log.info("generation paused (mode=%s, %d requests aborted%s)", mode, len(aborted),
                 f", {num_unanswered} not answered in time" if num_unanswered else "")
        self._json(200, {"message": "Generation paused successfully.", "status": "ok"})

    def continue_generation(self):
        scheduler = self.server.state.scheduler
        scheduler.run_in_loop(scheduler.resume, CONTROL_TIMEOUT_S)
        log.info("generation continued")
        self._json(200, {"message": "Generation continued successfully.", "status": "ok"})

    def update_weights_from_tensor(self):
        serialized = self.body.get("serialized_named_tensors")
        load_format = self.body.get("load_format")
        if not isinstance(serialized, list) or not serialized or not all(isinstance(s, str) for s in serialized):
            raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings")
        if not (load_format is None or isinstance(load_format, str)):
            raise ValueError("load_format must be a string or null")
        if not isinstance(self.body.get("flush_cache", True), bool):  # nothing to flush, but a typo is a 400
            raise ValueError("flush_cache must be a boolean")
        self._update_weights(lambda: read_weight_update(serialized, load_format), keep=keep_mapped)

    def update_weights_from_disk(self):
        model_path = self.body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ValueError("model_path must be a non-empty string")
        self._update_weights(lambda: read_safetensors_dir(model_path), extra={"num_paused_requests": 0})

    def init_weights_update_group(self):
        self.server.state.weight_groups.init(self.body)  # blocks until every rank joined
        self._json(200, {"success": True, "message": "Succeeded to initialize custom process group."})

    def destroy_weights_update_group(self):
        self.server.state.weight_groups.destroy(self.body)
        self._json(200, {"success": True, "message": "Succeeded to destroy custom process group."})

    def update_weights_from_distributed(self):
        try:
            named = self.server.state.weight_groups.receive(self.body)  # on this thread: generation goes on
        except WeightTransportError as e:
            log.warning("weight broadcast failed: %s", e)
            self._json(400, {"success": False, "message": f"Failed to receive weights: {e}"})
            return
        self._update_weights(lambda: named)

    def _update_weights(self, read: Callable[[], list], extra: dict | None = None,
                        keep: Callable[[list], None] | None = None) -> None:
        """Read an update with `read()` and check it against the model here, on the handler thread;
        then copy it in on the scheduler thread between two forwards and set weight_version.

        The request's bytes are decoded only here: whatever a malformed one raises ends this request
        (a WeightUpdateError is its 400), never the scheduler thread, on which any exception other
        than a ValueError ends the engine; generation also goes on while a payload is read and
        checked. `keep(named)` runs after the copy (the tensor transport holds its mappings so)."""
        version = self.body.get("weight_version")
        if not (version is None or isinstance(version, str)):
            raise ValueError("weight_version must be a string or null")
        scheduler = self.server.state.scheduler
        try:
            named = read()
            plan = plan_copy(scheduler.model, named)
        except WeightUpdateError as e:
            log.warning("weight update rejected: %s", e)
            self._json(400, {"success": False, "message": f"Failed to update weights: {e}", **(extra or {})})
            return

        def apply() -> int:
            start_s = time.perf_counter()
            num_tensors = copy_planned(plan)
            if keep is not None:
                keep(named)
            if version is not None:
                scheduler.weight_version = version
            log.info("weights updated: %d tensors in %.1f ms, weight_version=%s", num_tensors,
                     1000 * (time.perf_counter() - start_s), scheduler.weight_version)
            return num_tensors

        scheduler.run_in_loop(apply, CONTROL_TIMEOUT_S)
        message = "Success." + (f" Weight version updated to {version}." if version is not None else "")
        self._json(200, {"success": True, "message": message, **(extra or {})})


ROUTES = {
    ("POST", "/generate"): EngineHandler.generate,
    ("PUT", "/generate"): EngineHandler.generate,
    ("GET", "/health"): EngineHandler.health,
    ("GET", "/health_generate"): EngineHandler.health_generate,
    ("GET", "/model_info"): EngineHandler.model_info,
    ("GET", "/get_model_info"): EngineHandler.model_info,
    ("GET", "/server_info"): EngineHandler.server_info,
    ("GET", "/get_server_info"): EngineHandler.server_info,
    ("GET", "/metrics"): EngineHandler.metrics,
    ("GET", "/flush_cache"): EngineHandler.flush_cache,
    ("POST", "/flush_cache"): EngineHandler.flush_cache,
    ("POST", "/pause_generation"): EngineHandler.pause_generation,
    ("POST", "/continue_generation"): EngineHandler.continue_generation,
    ("POST", "/update_weights_from_tensor"): EngineHandler.update_weights_from_tensor,
    ("POST", "/update_weights_from_disk"): EngineHandler.update_weights_from_disk,
    ("POST", "/init_weights_update_group"): EngineHandler.init_weights_update_group,
    ("POST", "/update_weights_from_distributed"): EngineHandler.update_weights_from_distributed,
    ("POST", "/destroy_weights_update_group"): EngineHandler.destroy_weights_update_group,
}
