"""Shared fixtures: the project's small policy and a real local engine process serving it."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200; fail early if `proc` died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


@pytest.fixture(scope="session")
def policy_dir() -> Path:
    """The project's small policy (HF directory), built once and cached if missing."""
    from nano_miles.policy import ensure_policy

    return ensure_policy()


def start_engine(model_dir: Path, log_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, str(REPO / "procs" / "engine.py"), "--model-path", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--weight-version", "0", *extra]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(url + "/health", timeout_s=120, proc=proc)
    except Exception:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"engine failed to start; log:\n{log_path.read_text()[-3000:]}")
    return proc, url


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def engine_url(policy_dir, tmp_path_factory):
    """A real local engine process serving the small policy; stopped after the module."""
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    proc, url = start_engine(policy_dir, log_path)
    yield url
    stop_process(proc)
