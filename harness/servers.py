"""Engine servers as child processes for tests and benchmarks: the local engine, or SGLang on a GPU.

`proc, url = start_local_engine(model_dir, log_path)` or `start_sglang(model_dir, log_path)`, then
`stop_process(proc)` / `stop_sglang(proc)`. The pipeline itself starts engines under supervisord.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def proc_command(name: str) -> list[str]:
    """How supervisord starts the pipeline process `name` (a file of procs/), with this interpreter."""
    return [sys.executable, str(REPO_ROOT / "procs" / f"{name}.py")]


# Without the FA3 kernels SGLang needs triton attention. CUDA graphs stay on, as in every shipped GPU
# config: the tests then check what users run (a graph-captured engine serving updated weights).
SGLANG_EXTRA_ARGS = "--attention-backend triton"


# The ports the runs of this process are given lie below Linux's ephemeral range (32768-60999 by default),
# from which the OS also picks the source port of every client connection: a port picked there and bound
# seconds later by a stage could meanwhile be held by a connection (a trainer that cannot bind its
# metrics port, five restarts in a row). Each pytest-xdist worker hands out its own share of the range.
PORT_RANGE = (10000, 32768)
_next_port: int | None = None  # where this process's search goes on: no port is handed out twice


def port_share() -> tuple[int, int]:
    """[low, high) of the ports this process hands out: its pytest-xdist worker's share, else all."""
    low, high = PORT_RANGE
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return low, high
    size = (high - low) // count
    return low + int(worker[2:]) * size, low + (int(worker[2:]) + 1) * size


def free_ports_in_a_row(count: int) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1, free now and never handed out before by
    this process (engine replicas serve on port, port + 1, ...)."""
    global _next_port
    low, high = port_share()
    if _next_port is None or not low <= _next_port < high:
        _next_port = random.randrange(low, high)  # processes of one share start apart
    for _ in range(high - low):
        first = _next_port if _next_port + count <= high else low
        _next_port = first + 1
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        _next_port = first + count
        return first
    raise RuntimeError(f"no {count} free ports in a row on 127.0.0.1 in {low}-{high - 1}")


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now and never handed out before by this process."""
    return free_ports_in_a_row(1)


def wait_for_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200; fail early, naming it, if `proc` died."""
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


def launch(model_dir: Path | str, log_path: Path, overrides: list[str], timeout_s: float, stop, *,
           is_new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """An engine on a free port through the pipeline's own launcher (`procs/engine.py`),
    the way supervisord starts one; it execs the server, so `proc` is the server itself."""
    port = free_port()
    cmd = [*proc_command("engine"), f"--model.path={model_dir}", f"--engine.port={port}", *overrides]
    return spawn_server(cmd, log_path, f"http://127.0.0.1:{port}", timeout_s, stop,
                        is_new_session=is_new_session)


def start_local_engine(model_dir: Path | str, log_path: Path, *,
                       timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    return launch(model_dir, log_path, ["--engine.kind=local"], timeout_s, stop_process)


def unwind_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, `kill`) end this process through its `finally` blocks. A server or
    supervisord started in a session of its own never sees a signal sent to this process, so without
    this a killed bench leaves them running (on a GPU: holding its memory)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def spawn_server(cmd: list[str], log_path: Path, url: str, timeout_s: float, stop, *,
                 is_new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """Start an HTTP server process logging to `log_path`; return once `url`/health answers.

    On failure the process is stopped with `stop(proc)` and the log's tail is in the error."""
    if is_new_session:
        unwind_on_sigterm()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=is_new_session)
    try:
        wait_for_http(url + "/health", timeout_s=timeout_s, proc=proc)
    except (RuntimeError, TimeoutError):
        stop(proc)
        raise RuntimeError(f"{' '.join(cmd[1:3])} failed to start; log:\n{Path(log_path).read_text()[-4000:]}")
    return proc, url


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0, *, is_group: bool = False) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; to the whole process group (a server started in its
    own session, with children of its own) when `is_group`."""
    if proc.poll() is not None:
        return
    send = (lambda sig: os.killpg(proc.pid, sig)) if is_group else proc.send_signal
    send(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


def start_sglang(model_dir: Path | str, log_path: Path, *, dtype: str = "bfloat16",
                 extra_args: str = SGLANG_EXTRA_ARGS, mem_fraction_static: float = 0.3,
                 timeout_s: float = 420.0) -> tuple[subprocess.Popen, str]:
    # own process group (new session): SGLang's scheduler and detokenizer children go down with it
    return launch(model_dir, log_path, ["--engine.kind=sglang", f"--engine.dtype={dtype}",
                                        f"--engine.mem_fraction_static={mem_fraction_static}",
                                        f"--engine.extra_args={extra_args}"],
                  timeout_s, stop_sglang, is_new_session=True)


def stop_sglang(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    stop_process(proc, timeout_s, is_group=True)
