"""Local engine HTTP layer against hostile or broken clients: a real engine process, raw sockets.
Run: pytest tests/test_engine_http.py
"""

import http.client
import json
import socket
import struct
import time
from urllib.parse import urlsplit

import pytest

from conftest import start_engine, stop_process
from nano_miles.engine.client import EngineClient
from nano_miles.local_engine.server import SOCKET_TIMEOUT_S


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
