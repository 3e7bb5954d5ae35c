"""The reward function run in a child process, with a per-call timeout, so that a raise or a hang
costs one sample, never the stage calling it (the reward stage scores with it, the trainer's
held-out evaluation too), unless the function fails so often that it is broken (`FailureLimit`).
Library module; `tests/test_reward_faults.py` drives it.

A hanging Python function cannot be stopped from another thread, but a process can be killed: the
worker is forked once and reused (the fast path is one Pipe round trip per sample); on a timeout it
is killed and a fresh one forked for the next sample. Fork (not spawn) so that any callable works,
including closures, and a replacement starts in milliseconds.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from nano_miles.rewards import with_facts
from nano_miles.run.cli import UserError

log = logging.getLogger("reward")

REASON_ERROR = "reward_error"          # the function raised, returned garbage, or its worker died
REASON_TIMEOUT = "reward_timeout"      # no answer within the per-sample budget
REASON_NONFINITE = "reward_nonfinite"  # a NaN or infinite reward or part
REASONS = (REASON_ERROR, REASON_TIMEOUT, REASON_NONFINITE)


class RewardFailure(Exception):
    """One sample could not be scored; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _serve(conn: Connection, reward_fn) -> None:
    """Child: answer (response, label, facts) with ("ok", values) or ("error", text) until the pipe closes."""
    from nano_miles.run.process import die_with_parent
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the stage's handler would run its cleanup here
    while True:
        try:
            response, label, facts = conn.recv()
        except EOFError:
            return
        try:
            out = reward_fn(response, label, facts)
            values = {str(k): float(v) for k, v in out.items()}
            reply = ("ok", values)
        except Exception as e:  # user code: any exception it raises is a scoring failure, not ours
            reply = ("error", f"{type(e).__name__}: {str(e)[:200]}")
        conn.send(reply)


@dataclass
class RewardWorker:
    """Calls `reward_fn(response, label)` in a forked child, at most `timeout_s` per call; with `facts`
    (`nano_miles.rewards.sample_facts`) `reward_fn(response, label, facts)`."""

    reward_fn: object
    timeout_s: float
    num_restarts: int = 0
    proc: mp.Process | None = field(default=None, repr=False)
    conn: Connection | None = field(default=None, repr=False)

    def start(self) -> None:
        ctx = mp.get_context("fork")
        parent_end, child_end = ctx.Pipe()
        # as a function of (response, label, facts): what `load_reward` returns, or any (response, label) one
        fn = with_facts(self.reward_fn, "the reward function")
        self.proc = ctx.Process(target=_serve, args=(child_end, fn), daemon=True, name="reward-worker")
        self.proc.start()
        child_end.close()
        self.conn = parent_end

    def __call__(self, response: str, label: str, facts: dict | None = None) -> dict[str, float]:
        """The reward and its parts, all finite floats; RewardFailure naming the reason otherwise."""
        if self.proc is None:
            self.start()
        try:
            self.conn.send((response, label, facts))
            is_ready = self.conn.poll(self.timeout_s)
            reply = self.conn.recv() if is_ready else None
        except (EOFError, OSError) as e:  # the worker died under the call (os._exit, a crash, OOM)
            self.restart()
            raise RewardFailure(REASON_ERROR, f"reward worker died ({type(e).__name__})") from None
        if reply is None:
            self.restart()
            raise RewardFailure(REASON_TIMEOUT, f"no answer within {self.timeout_s:g}s")
        status, value = reply
        if status == "error":
            raise RewardFailure(REASON_ERROR, value)
        if "reward" not in value:
            raise RewardFailure(REASON_ERROR, f"no 'reward' key in {sorted(value)[:8]}")
        bad = [k for k, v in value.items() if not math.isfinite(v)]
        if bad:
            raise RewardFailure(REASON_NONFINITE, f"non-finite {', '.join(f'{k}={value[k]}' for k in bad)}")
        return value

    def restart(self) -> None:
        self.stop()
        self.num_restarts += 1
        self.start()

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGKILL)  # a hung function ignores anything gentler
            self.proc.join(timeout=5.0)
            self.proc = None


class FailureLimit:
    """Tells a broken reward function from an unlucky sample. `check` after each batch scored (a group
    in the reward stage, a held-out pass in the trainer's evaluation) raises a UserError naming the
    function and its last error when every sample of the batch failed, or when more than
    `max_fraction` of all the samples checked so far did; a failure that costs a sample now and then
    goes on costing that sample only."""

    def __init__(self, what: str, max_fraction: float):
        self.what, self.max_fraction = what, max_fraction  # `what`: the function, as `describe` names it
        self.num_scored = self.num_failed = 0

    def check(self, num_scored: int, failures: list[RewardFailure]) -> None:
        self.num_scored += num_scored
        self.num_failed += len(failures)
        if not failures:
            return
        if len(failures) == num_scored:
            raise UserError(f"{self.what} failed on all {num_scored} samples of a batch; the last: {failures[-1]}")
        if self.num_failed > self.max_fraction * self.num_scored:
            raise UserError(f"{self.what} failed on {self.num_failed} of the {self.num_scored} samples scored, "
                            f"more than reward.max_failure_fraction = {self.max_fraction:g}; the last: "
                            f"{failures[-1]}")


def score(worker: RewardWorker, response: str, label: str, on_failure=None, facts: dict | None = None) -> dict[str, float]:
    """The reward and its parts of one sample; a sample that cannot be scored gets reward 0 (and no
    parts), and `on_failure(failure)` is told why."""
    try:
        return worker(response, label, facts)
    except RewardFailure as failure:
        if on_failure is not None:
            on_failure(failure)
        return {"reward": 0.0}
