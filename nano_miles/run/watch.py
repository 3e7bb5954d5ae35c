"""What the run's supervisord event listener decides: end the run when training is done or a stage cannot
be kept running, restart a stage that hangs.

Library module of `procs/run_end.py`, the `[eventlistener:run_end]` of supervisord.conf.

* The trainer exits with an expected code: training is done (0), or the trainer refused to start (2: a
  config it cannot run, a run directory holding a finished run; its one line says why); supervisord
  is asked to shut down, so `supervisord -c supervisord.conf` returns by itself.
* A stage cannot be kept running: it entered FATAL (it died faster than supervisord's `startsecs`),
  or it exited MAX_QUICK_CRASHES times in a row within CRASH_WINDOW_S of starting (a stage that loads
  a model outlives `startsecs` before it fails, and supervisord would restart it forever). The listener
  writes `FAILED` naming the stage into the run directory and shuts the run down.
* A stage hangs: on each TICK_5 it reads the stages' heartbeats (`nano_miles/run/liveness.py`); a stage
  whose loop has not beaten for `run.hang_timeout_s` gets SIGKILL through supervisord's XML-RPC
  interface, and supervisord starts it again. Each such restart is logged here and appended to
  `<run dir>/events.jsonl`. A stage is judged only after its loop has beaten once (loading a large
  model is slow, not hung).
"""

from __future__ import annotations

import json
import sys
import time
import xmlrpc.client
from pathlib import Path

from nano_miles.run.liveness import read_heartbeat

CRASH_WINDOW_S = 30.0   # an exit this soon after its start counts as a crash on start
MAX_QUICK_CRASHES = 5   # this many in a row: the stage cannot run (a chaos test kills up to 3 in a row)
GROUP = "nanomiles"
WATCHED = ("rollout", "reward", "trainer")  # stages that beat (the engine is SGLang's or ours: no beat)


def parse_payload(payload: str) -> dict[str, str]:
    return dict(token.split(":", 1) for token in payload.split() if ":" in token)


class RunWatch:
    """What the listener decides, apart from the supervisord plumbing (so tests drive it directly)."""

    def __init__(self, run_dir: Path, hang_timeout_s: float, supervisor=None):
        self.run_dir, self.hang_timeout_s, self.supervisor = run_dir, hang_timeout_s, supervisor
        self.started_at: dict[str, float] = {}
        self.quick_crashes: dict[str, int] = {}
        self.killed_for_hang: set[str] = set()
        self.is_ending = False  # shutdown asked for: supervisord answers no more process calls

    def on_event(self, event: str, fields: dict[str, str], now: float) -> str | None:
        """The reason to end the run for this event, or None to keep going."""
        name = fields.get("processname", "")
        if event == "PROCESS_STATE_STARTING":
            self.started_at[name] = now
        elif event == "PROCESS_STATE_EXITED":
            if name == "trainer" and fields.get("expected") == "1":
                return self.trainer_end()
            if name in self.killed_for_hang:  # our own restart, not the stage's failure
                self.killed_for_hang.discard(name)
                return None
            is_quick = now - self.started_at.get(name, now) < CRASH_WINDOW_S
            self.quick_crashes[name] = self.quick_crashes.get(name, 0) + 1 if is_quick else 0
            if self.quick_crashes[name] >= MAX_QUICK_CRASHES:
                return (f"failed: {name} exited {self.quick_crashes[name]} times in a row within "
                        f"{CRASH_WINDOW_S:.0f}s of starting; see {name}.log")
        elif event == "PROCESS_STATE_FATAL":
            return f"failed: {name} could not be kept running; see {name}.log"
        elif event.startswith("TICK") and self.hang_timeout_s > 0 and not self.is_ending:
            try:
                self.restart_hung(now)
            except (xmlrpc.client.Fault, OSError) as e:  # supervisord busy or going away: next tick
                log(f"cannot check the stages this tick: {e}")
        return None

    def trainer_end(self) -> str:
        """The trainer exits 0 when training is done and 2 when it refuses to start (a config it cannot
        run, a run directory that holds a finished run): both end the run, only one as done."""
        status = 0 if self.supervisor is None else self.supervisor.getProcessInfo(f"{GROUP}:trainer")["exitstatus"]
        return "done" if status == 0 else f"refused: the trainer would not start (exit {status}); see trainer.log"

    def restart_hung(self, now: float) -> None:
        for stage in WATCHED:
            info = self.supervisor.getProcessInfo(f"{GROUP}:{stage}")
            beat = read_heartbeat(self.run_dir, stage)
            if info["statename"] != "RUNNING" or beat is None or beat.get("pid") != info["pid"] \
                    or beat.get("waiting_for") == "starting":
                continue
            silent_s = now - float(beat["time"])
            if silent_s <= self.hang_timeout_s:
                continue
            self.killed_for_hang.add(stage)
            self.supervisor.signalProcess(f"{GROUP}:{stage}", "KILL")
            event = {"time": now, "event": "hang_restart", "stage": stage, "silent_s": round(silent_s, 1),
                     "waiting_for": beat.get("waiting_for", "")}
            log(f"{stage} has not beaten for {silent_s:.0f}s (> run.hang_timeout_s={self.hang_timeout_s:g}); "
                f"restarting it")
            with open(self.run_dir / "events.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")


def log(line: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} run_end: {line}\n")
    sys.stderr.flush()
