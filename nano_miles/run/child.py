"""A function run in a child process with a time limit per call, so that a raise or a hang costs one
call, never the process calling it. Library module under the reward worker (`nano_miles/rewards/worker.py`)
and the calculator tool (`nano_miles/rollouts/calculator.py`); `tests/test_reward_faults.py` drives it.

A hanging Python function cannot be stopped from another thread, but a process can be killed: the
child is started once and reused (the fast path is one Pipe round trip per call); on a timeout it is
killed and a fresh one started for the next call. Start method "fork" takes any callable, closures
included, and a replacement starts in milliseconds (the reward worker, forked before the stage has
threads); "spawn" takes a module-level function and is safe from a process that already runs threads
(the rollout producer's tools). Calls are serialized: one child answers one call at a time. The time
limit is the function's: a fresh child says when it has started, and its first call is timed from there.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

DIED, ERROR, TIMEOUT = "died", "error", "timeout"  # why a call failed
START_TIMEOUT_S = 60.0  # for a fresh child to start and say so, before its first call is timed


class CallFailed(Exception):
    """One call had no answer: the function raised (ERROR), ran out of time (TIMEOUT) or its process
    died under it (DIED)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _serve(conn, fn) -> None:
    """Child: answer each args tuple with ("ok", fn(*args)) or ("error", text) until the pipe closes."""
    from nano_miles.run.process import die_with_parent
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler would run its cleanup here
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C is the parent's to handle
    conn.send(("ready", None))  # started: from here on a call's time is the function's own
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", fn(*args))
        except Exception as e:  # user code: any exception it raises fails this call, not the child
            reply = ("error", f"{type(e).__name__}: {str(e)[:200]}")
        conn.send(reply)


class ChildFunction:
    """`fn(*args)` in a child process, at most `timeout_s` per call."""

    def __init__(self, fn, timeout_s: float, *, start_method: str = "fork", name: str = "child"):
        self.fn, self.timeout_s, self.start_method, self.name = fn, timeout_s, start_method, name
        self.num_restarts = 0
        self.proc = self.conn = None
        self.is_ready = False
        self.lock = threading.Lock()

    def start(self) -> None:
        ctx = mp.get_context(self.start_method)
        parent_end, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child_end, self.fn), daemon=True, name=self.name)
        self.proc.start()
        child_end.close()
        self.conn, self.is_ready = parent_end, False

    def __call__(self, *args):
        """fn(*args), or CallFailed naming why there is no answer."""
        with self.lock:
            if self.proc is None:
                self.start()
            try:
                if not self.is_ready:  # a fresh child: its start-up (a spawned one imports Python anew,
                    # seconds on a loaded machine) is not the call's time
                    if not self.conn.poll(START_TIMEOUT_S):
                        self._restart()
                        raise CallFailed(DIED, f"{self.name} did not start within {START_TIMEOUT_S:g}s")
                    self.conn.recv()
                    self.is_ready = True
                self.conn.send(args)
                reply = self.conn.recv() if self.conn.poll(self.timeout_s) else None
            except (EOFError, OSError) as e:  # the child died under the call (os._exit, a crash, OOM)
                self._restart()
                raise CallFailed(DIED, f"{self.name} died ({type(e).__name__})") from None
            if reply is None:
                self._restart()
                raise CallFailed(TIMEOUT, f"no answer within {self.timeout_s:g}s")
        status, value = reply
        if status == "error":
            raise CallFailed(ERROR, value)
        return value

    def _restart(self) -> None:
        self._stop()
        self.num_restarts += 1
        self.start()

    def stop(self) -> None:
        with self.lock:
            self._stop()

    def _stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGKILL)  # a hung function ignores anything gentler
            self.proc.join(timeout=5.0)
            self.proc = None
