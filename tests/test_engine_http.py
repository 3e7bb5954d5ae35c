"""Local engine HTTP layer against hostile or broken clients: a real engine process, raw sockets.
Run: pytest tests/test_engine_http.py
"""

import base64
import copyreg
import http.client
import io
import json
import os
import pickle
import socket
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
import torch
from torch._utils import _rebuild_tensor_v2
from torch.multiprocessing.reductions import rebuild_storage_filename, rebuild_typed_storage

from conftest import start_engine, stop_process
from nano_miles.engine.client import EngineClient
from nano_miles.local_engine.server import SOCKET_TIMEOUT_S
from nano_miles.weights.tensor_sender import serialize_named_tensors


@pytest.fixture(scope="module")
def engine(policy_dir, tmp_path_factory):
    """(base URL, log file) of a real local engine serving the small policy; stopped after the module."""
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    proc, url = start_engine(policy_dir, log_path)
    yield url, log_path
    stop_process(proc)


def connect(url: str, timeout_s: float = 10) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)


def request(method: str, path: str, body: bytes = b"", headers: str | None = None) -> bytes:
    """Raw request bytes; `headers` replaces the default Content-Length line."""
    headers = f"Content-Length: {len(body)}\r\n" if headers is None else headers
    return f"{method} {path} HTTP/1.1\r\nHost: engine\r\n{headers}\r\n".encode() + body


def exchange(url: str, raw: bytes, timeout_s: float = 10) -> tuple[int, http.client.HTTPMessage, bytes]:
    """Send raw bytes on a new connection and read one response: (status, headers, body)."""
    with connect(url, timeout_s) as sock:
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.headers, response.read()


def error_message(path: str, body: bytes) -> str:
    """The message of either error envelope: /generate's, or the OpenAI-style one of the other routes."""
    reply = json.loads(body)
    return reply["error"]["message"] if path == "/generate" else reply["message"]


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset, as a killed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def still_serves(url: str) -> bool:
    out = EngineClient(url, timeout_s=30).generate([1, 2], {"max_new_tokens": 1})
    return out["meta_info"]["finish_reason"] is not None


@pytest.mark.parametrize("path", ["/generate", "/update_weights_from_tensor"])
def test_deeply_nested_json_gets_400_in_the_routes_envelope(engine, path):
    url, _ = engine
    status, _, body = exchange(url, request("POST", path, b"[" * 100_000))
    assert status == 400 and "nested too deeply" in error_message(path, body)
    assert still_serves(url)


@pytest.mark.parametrize("length", [1 << 30, 10**15])
def test_body_over_the_limit_gets_413_without_being_read(engine, length):
    url, _ = engine
    for path in ("/generate", "/update_weights_from_tensor"):
        # headers only: an answer at all shows the engine did not wait for the body
        status, headers, body = exchange(url, request("POST", path, headers=f"Content-Length: {length}\r\n"))
        assert status == 413 and headers["Connection"] == "close"
        assert "limit" in error_message(path, body)
    assert still_serves(url)


def test_client_that_stalls_after_its_headers_is_disconnected(engine):
    url, _ = engine
    with connect(url, timeout_s=30) as sock:
        sock.sendall(request("POST", "/generate", headers="Content-Length: 100\r\n"))
        start_s = time.monotonic()
        assert sock.recv(1) == b""  # the engine closed it; our own timeout would raise instead
        assert time.monotonic() - start_s < 20
    assert still_serves(url)


def test_keep_alive_connection_closed_when_idle_is_reopened_by_the_client(engine):
    url, _ = engine
    client = EngineClient(url, timeout_s=30)
    assert client.server_info()["version"]
    time.sleep(SOCKET_TIMEOUT_S + 1)  # the engine closes the connection the client keeps
    assert client.server_info()["version"]


@pytest.mark.parametrize("method,path,allow", [("GET", "/generate", "POST, PUT"), ("POST", "/health", "GET"),
                                               ("DELETE", "/flush_cache", "GET, POST")])
def test_known_route_with_another_method_gets_405_and_allow(engine, method, path, allow):
    url, _ = engine
    status, headers, body = exchange(url, request(method, path))
    assert status == 405 and headers["Allow"] == allow
    assert json.loads(body) == {"detail": "Method Not Allowed"}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_unknown_route_is_still_404(engine, method):
    status, _, body = exchange(engine[0], request(method, "/no_such_route", b"{}"))
    assert status == 404 and json.loads(body) == {"detail": "Not Found"}


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)


@pytest.mark.parametrize("path", ["/generate", "/pause_generation"])
def test_chunked_body_or_no_content_length_gets_411(engine, path):
    url, _ = engine
    body = chunked(b'{"input_ids": [1, 2]}' if path == "/generate" else b'{"mode": "abort"}')
    status, _, reply = exchange(url, request("POST", path, body, headers="Transfer-Encoding: chunked\r\n"))
    assert status == 411 and "chunked" in error_message(path, reply)
    status, _, reply = exchange(url, request("POST", path, headers=""))
    assert status == 411 and "Content-Length" in error_message(path, reply)
    assert still_serves(url)


def test_client_hanging_up_mid_request_or_response_logs_one_line_not_a_traceback(engine):
    url, log_path = engine
    client = EngineClient(url, timeout_s=30)
    start = log_path.stat().st_size
    # mid-request: half of the body, then a reset while the engine reads the rest
    sock = connect(url)
    sock.sendall(request("POST", "/generate", b'{"input_ids": [1, 2', headers="Content-Length: 40\r\n"))
    time.sleep(0.3)
    reset(sock)
    # mid-response: the request waits behind a pause, its client resets, then the answer is written
    client.pause("in_place")
    sock = connect(url)
    sock.sendall(request("POST", "/generate", json.dumps({"input_ids": [1, 2]}).encode()))
    time.sleep(0.3)
    reset(sock)
    client.resume()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = log_path.read_bytes()[start:].decode()
        if new.count("went away") >= 2 or "Traceback" in new:
            break
        time.sleep(0.1)
    assert "Traceback" not in new
    lines = [line for line in new.splitlines() if "generation paused" not in line and "continued" not in line]
    assert len(lines) == 2 and all("went away" in line for line in lines), new
    assert still_serves(url)


# ---- malformed weight updates: every one a 400 with a message, the engine keeps serving ----

class Call:
    """Pickles as `fn(*args)`: payloads an honest sender never builds, from allow-listed callables only."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class MetaStoragePickler(pickle.Pickler):
    """Pickles a meta-device storage as `UntypedStorage.__new__(UntypedStorage, n, device="meta")`
    (a NEWOBJ_EX of an allow-listed class): a tensor without data that passes name and shape checks."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "meta":
            return copyreg.__newobj_ex__, (type(obj), (obj.nbytes(),), {"device": "meta"})
        return NotImplemented


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def crafted(obj, pickler=pickle.Pickler) -> str:
    buf = io.BytesIO()
    pickler(buf, 4).dump(obj)
    return b64(buf.getvalue())


@dataclass
class Target:
    """A real parameter of the served policy; `payload` keeps its tensors' shared memory alive."""
    name: str
    shape: tuple[int, ...]
    held: list = field(default_factory=list)

    def payload(self, *named) -> str:
        self.held += named
        return serialize_named_tensors(named)

    def tensor_of(self, storage, dtype=torch.float32):
        stride = torch.empty(self.shape).stride()
        return Call(_rebuild_tensor_v2, Call(rebuild_typed_storage, storage, dtype), 0, self.shape, stride,
                    False, OrderedDict())


def tensors_body(serialized, **fields) -> dict:
    return {"serialized_named_tensors": serialized, "weight_version": "bad", **fields}


def truncated(t: Target) -> str:
    raw = base64.b64decode(t.payload((t.name, torch.zeros(t.shape))))
    return b64(raw[: len(raw) // 2])


HUGE_SEGMENT = Call(rebuild_storage_filename, torch.UntypedStorage, b"manager", b"/nm", 2**70)
META = torch.UntypedStorage(4, device="meta")
BAD_WEIGHT_BODIES = [  # (what, body of a Target, a fragment of the message)
    ("not base64", lambda t: tensors_body(["not base64!!"]), "base64"),
    ("truncated pickle", lambda t: tensors_body([truncated(t)]), "cannot rebuild"),
    ("forbidden callable", lambda t: tensors_body([crafted(Call(os.system, "true"))]), "forbidden global"),
    ("unknown callable", lambda t: tensors_body([b64(b"\x80\x02ctorch\nno_such_thing\n.")]), "forbidden global"),
    ("size past int64", lambda t: tensors_body([crafted([(t.name, HUGE_SEGMENT)])]), "cannot rebuild"),
    ("negative size", lambda t: tensors_body([crafted([(t.name, Call(rebuild_storage_filename, torch.UntypedStorage,
                                                                     b"m", b"/nm", -1))])]), "cannot rebuild"),
    ("metadata not a dict", lambda t: tensors_body([crafted([(t.name, Call(
        _rebuild_tensor_v2, Call(rebuild_typed_storage, Call(torch.UntypedStorage, 4), torch.float32), 0, (1,), (1,), False, None, 5))])]), "cannot rebuild"),
    ("not a list", lambda t: tensors_body([crafted({t.name: 1})]), "list of"),
    ("no tensor", lambda t: tensors_body([crafted([(t.name, 1)])]), "list of"),
    ("no pairs", lambda t: tensors_body([crafted([])]), "no tensors"),
    ("unknown name", lambda t: tensors_body([t.payload(("no.such.weight", torch.zeros(t.shape)))]), "unknown"),
    ("wrong shape", lambda t: tensors_body([t.payload((t.name, torch.zeros(3, 5)))]), "shape"),
    ("not finite", lambda t: tensors_body([t.payload((t.name, torch.full(t.shape, float("nan"))))]), "finite"),
    ("integer dtype", lambda t: tensors_body([t.payload((t.name, torch.zeros(t.shape, dtype=torch.int32)))]), "dtype"),
    ("float8 dtype", lambda t: tensors_body([t.payload((t.name, torch.zeros(t.shape).to(torch.float8_e4m3fn)))]),
     "dtype"),
    ("meta tensor", lambda t: tensors_body([crafted([(t.name, t.tensor_of(META))], MetaStoragePickler)]), "device"),
    ("two ranks", lambda t: tensors_body([t.payload((t.name, torch.zeros(t.shape)))] * 2), "one"),
    ("not a list of strings", lambda t: tensors_body([1, 2]), "serialized_named_tensors"),
    ("one string", lambda t: tensors_body("abc"), "serialized_named_tensors"),
    ("no tensors key", lambda t: {"weight_version": "bad"}, "serialized_named_tensors"),
    ("load_format number", lambda t: tensors_body(["abc"], load_format=5), "load_format"),
    ("load_format unknown", lambda t: tensors_body([t.payload((t.name, torch.zeros(t.shape)))],
                                                   load_format="flattened_bucket"), "load_format"),
    ("weight_version number", lambda t: {**tensors_body(["abc"]), "weight_version": 7}, "weight_version"),
    ("flush_cache text", lambda t: tensors_body(["abc"], flush_cache="yes"), "flush_cache"),
]


@pytest.fixture(scope="module")
def target(policy_dir) -> Target:
    from safetensors import safe_open

    with safe_open(str(policy_dir / "model.safetensors"), "pt") as f:
        name = next(n for n in f.keys() if n.endswith("norm.weight"))
        return Target(name, tuple(f.get_slice(name).get_shape()))


@pytest.mark.parametrize("make_body,fragment", [case[1:] for case in BAD_WEIGHT_BODIES],
                         ids=[case[0] for case in BAD_WEIGHT_BODIES])
def test_malformed_weight_update_gets_400_and_engine_keeps_serving(engine, target, make_body, fragment):
    url, log_path = engine
    start = log_path.stat().st_size
    body = json.dumps(make_body(target)).encode()
    status, _, reply = exchange(url, request("POST", "/update_weights_from_tensor", body), timeout_s=30)
    assert status == 400, reply
    assert fragment.lower() in error_message("/update_weights_from_tensor", reply).lower(), reply
    assert still_serves(url)
    assert EngineClient(url).model_info()["weight_version"] == "0"  # nothing of the update was applied
    assert "Traceback" not in log_path.read_bytes()[start:].decode()
