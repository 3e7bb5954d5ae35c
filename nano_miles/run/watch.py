"""What the run's supervisord event listener decides: end the run when training is done or a stage cannot
be kept running, restart a stage or an engine that hangs.

Library module of `procs/run_end.py`, the `[eventlistener:run_end]` of supervisord.conf.

* The trainer exits 0: training is done; supervisord is asked to shut down, so
  `supervisord -c supervisord.conf` returns by itself.
* Any program exits 2: it met a mistake in what it was given (a config that does not parse, a data
  file or model directory it cannot use, a run directory that holds a finished run). Every stage
  reads the same config, so restarting would only repeat the mistake: the run ends at once, and FAILED
  quotes the program's last line (its one-line error). On a finished run nothing is written into it.
* A stage cannot be kept running: it entered FATAL, or it exited MAX_QUICK_CRASHES times in a row
  within CRASH_WINDOW_S of starting (a stage that loads a model outlives `startsecs` before it fails,
  and supervisord would restart it forever), or, for an engine the watch asks for /health, before it
  ever answered, or, for the trainer, before it trained a step past the furthest one in metrics.jsonl
  (SGLang refusing its memory share for a 3B model exited about 45 s after each start, a 3B trainer out
  of memory 38 s after each start, and a 3B trainer whose final checkpoint did not fit on the disk
  trained its three steps again after each start, for as long as a run lasted). FAILED names the stage
  and quotes its log's last line.
* A stage hangs: on each TICK_5 the watch reads the stages' heartbeats (`nano_miles/run/liveness.py`)
  and asks each engine of its own slots for /health. An engine that has not answered for
  `run.hang_timeout_s` is restarted. While any engine does not answer, the stages are not judged (they
  wait for it, and it is the one to restart), and a stage's silence counts from when they all answer
  again. Otherwise a stage whose loop has not beaten for `run.hang_timeout_s` gets SIGKILL through
  supervisord's XML-RPC interface, and supervisord starts it again. Each such restart is logged and
  appended to `<run dir>/events.jsonl`. A stage is judged only after its loop has beaten once, an
  engine only after it answered once (loading is slow, not hung).
"""

from __future__ import annotations

import json
import sys
import time
import xmlrpc.client
from collections.abc import Callable
from pathlib import Path

from nano_miles.run.cli import EXIT_USAGE
from nano_miles.run.identity import FINISHED_FILE
from nano_miles.run.liveness import read_heartbeat

CRASH_WINDOW_S = 30.0   # an exit this soon after its start counts as a crash on start
MAX_QUICK_CRASHES = 5   # this many in a row: the stage cannot run (a chaos test kills up to 3 in a row)
GROUP = "nanomiles"
WATCHED = ("rollout", "reward", "trainer")  # stages that beat
FAILED_FILE = "FAILED"
METRICS_FILE = "metrics.jsonl"  # the trainer appends a line as each step ends
LAST_LINE_BYTES = 8192  # how much of a log's end is read for its last line
MAX_QUOTE_CHARS = 400


def parse_payload(payload: str) -> dict[str, str]:
    return dict(token.split(":", 1) for token in payload.split() if ":" in token)


def last_line(path: Path) -> str:
    """The last non-empty line of a log, shortened to a quote; what is missing, if there is no log."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - LAST_LINE_BYTES))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no {path.name} in the run directory"
    if not lines:
        return f"{path.name} is empty"
    return lines[-1] if len(lines[-1]) <= MAX_QUOTE_CHARS else lines[-1][:MAX_QUOTE_CHARS] + "..."


class RunWatch:
    """What the listener decides, apart from the supervisord plumbing (so tests drive it directly).

    `engines` maps the engine programs of this run's slots to their URLs (none for engines the run
    does not start); `is_answering(url)` asks one of them for /health."""

    def __init__(self, run_dir: Path, hang_timeout_s: float, supervisor=None, *,
                 engines: dict[str, str] | None = None, is_answering: Callable[[str], bool] = lambda url: True):
        self.run_dir, self.hang_timeout_s, self.supervisor = run_dir, hang_timeout_s, supervisor
        self.engines, self.is_answering = engines or {}, is_answering
        self.started_at: dict[str, float] = {}
        self.metrics_at_start = 0  # the size of METRICS_FILE when the trainer last started
        self.furthest_step = 0  # the furthest step METRICS_FILE holds, of what the watch has read
        self.quick_crashes: dict[str, int] = {}
        self.killed_for_hang: set[str] = set()
        self.engine_answered: dict[str, tuple[int, float]] = {}  # program -> (pid, when it last answered)
        self.engines_back_at = 0.0  # when every engine answered again after one did not
        self.is_ending = False  # shutdown asked for: supervisord answers no more process calls

    def on_event(self, event: str, fields: dict[str, str], now: float) -> str | None:
        """The reason to end the run for this event, or None to keep going."""
        if self.is_ending:  # the end is decided; supervisord, shutting down, answers no more process calls
            return None
        name = fields.get("processname", "")
        if event == "PROCESS_STATE_STARTING":
            self.started_at[name] = now
            if name == "trainer":
                self.metrics_at_start = self.metrics_size()
        elif event == "PROCESS_STATE_EXITED":
            if fields.get("expected") == "1":
                return self.expected_exit(name)
            if name in self.killed_for_hang:  # our own restart, not the stage's failure
                self.killed_for_hang.discard(name)
                return None
            how = self.failed_start(name, fields.get("pid"), now)
            self.quick_crashes[name] = self.quick_crashes.get(name, 0) + 1 if how else 0
            if self.quick_crashes[name] >= MAX_QUICK_CRASHES:
                return f"failed: {name} exited {self.quick_crashes[name]} times in a row {how}; {self.quote(name)}"
        elif event == "PROCESS_STATE_FATAL":
            return f"failed: {name} could not be kept running; {self.quote(name)}"
        elif event.startswith("TICK") and self.hang_timeout_s > 0:
            try:
                self.restart_hung(now)
            except (xmlrpc.client.Fault, OSError) as e:  # supervisord busy or going away: next tick
                log(self.run_dir, f"cannot check the stages this tick: {e}")
        return None

    def failed_start(self, name: str, pid: str | None, now: float) -> str | None:
        """How this exit of `name` is a crash on start, or None: soon after its start, an engine before it ever
        answered /health, the trainer before it trained a step past the furthest one (it resumes from its
        newest checkpoint: a trainer that dies at the same point trains the same steps again and again)."""
        furthest = self.furthest_step
        if name == "trainer":
            self.furthest_step = max([furthest, *self.steps_since_start()])
        if now - self.started_at.get(name, now) < CRASH_WINDOW_S:
            return f"within {CRASH_WINDOW_S:.0f}s of starting"
        if self.never_answered(name, pid):
            return "before it answered /health"
        if name == "trainer" and self.furthest_step == furthest:
            return f"without training past step {furthest}" if furthest else "before it finished a step"
        return None

    def metrics_size(self) -> int:
        try:
            return (self.run_dir / METRICS_FILE).stat().st_size
        except OSError:  # no step yet
            return 0

    def steps_since_start(self) -> list[int]:
        """The steps the trainer wrote to METRICS_FILE since it last started (the file is only appended to)."""
        try:
            with (self.run_dir / METRICS_FILE).open("rb") as f:
                f.seek(self.metrics_at_start)
                lines = f.read().splitlines()
        except OSError:
            return []
        steps = []
        for line in lines:
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):  # a line cut short by the exit
                pass
        return steps

    def never_answered(self, name: str, pid: str | None) -> bool:
        """Is `name` an engine the ticks ask for /health, whose process `pid` never answered?"""
        if name not in self.engines or self.hang_timeout_s <= 0:  # not asked: no way to tell
            return False
        answered_pid, answered_at = self.engine_answered.get(name, (None, None))
        return str(answered_pid) != pid or answered_at is None

    def expected_exit(self, name: str) -> str | None:
        """An exit supervisord.conf lists as expected: 0 (the trainer is done; an engine slot the
        config does not use) or EXIT_USAGE (a mistake in what the program was given)."""
        try:
            status = 0 if self.supervisor is None else self.supervisor.getProcessInfo(f"{GROUP}:{name}")["exitstatus"]
        except xmlrpc.client.Fault as e:  # a shutdown someone else asked for (Ctrl-C): the run ends anyway
            log(self.run_dir, f"{name} exited while supervisord shuts down ({e.faultString})")
            return None
        if status == 0:
            return "done" if name == "trainer" else None
        if status == EXIT_USAGE and (self.run_dir / FINISHED_FILE).is_file():  # a finished run: leave it be
            return f"refused: {name} would not start on the finished run in {self.run_dir} (exit {status})"
        return f"failed: {name} stopped the run (exit {status}); {self.quote(name)}"

    def quote(self, program: str) -> str:
        """`<program>.log: <its last line>` (the program's one-line error, or its crash's last line)."""
        return f"{program}.log: {last_line(self.run_dir / f'{program}.log')}"

    def restart_hung(self, now: float) -> None:
        if not self.engines_answer(now):
            self.engines_back_at = float("inf")
            return  # the stages wait for an engine that does not answer: it is the one to judge
        if self.engines_back_at == float("inf"):
            self.engines_back_at = now  # a call that waited on the engine may still be returning
        for stage in WATCHED:
            info = self.supervisor.getProcessInfo(f"{GROUP}:{stage}")
            beat = read_heartbeat(self.run_dir, stage)
            if info["statename"] != "RUNNING" or beat is None or beat.get("pid") != info["pid"] \
                    or beat.get("waiting_for") == "starting":
                continue
            silent_s = now - max(float(beat["time"]), self.engines_back_at)
            if silent_s > self.hang_timeout_s:
                self.kill_for_hang(stage, now, silent_s, f"its loop has not beaten (waiting for "
                                                         f"{beat.get('waiting_for') or 'nothing'})")

    def engines_answer(self, now: float) -> bool:
        """Ask each running engine for /health; restart one silent for longer than the hang timeout.
        True if every running engine answered."""
        is_all = True
        for program, url in self.engines.items():
            info = self.supervisor.getProcessInfo(f"{GROUP}:{program}")
            if info["statename"] != "RUNNING":
                continue
            pid, answered_at = self.engine_answered.get(program, (info["pid"], None))
            if pid != info["pid"]:  # restarted: judged again once it has answered
                answered_at = None
            if self.is_answering(url):
                self.engine_answered[program] = (info["pid"], now)
                continue
            is_all = False
            self.engine_answered[program] = (info["pid"], answered_at)
            if answered_at is not None and now - answered_at > self.hang_timeout_s:
                self.engine_answered.pop(program)
                self.kill_for_hang(program, now, now - answered_at, f"it has not answered {url}/health")
        return is_all

    def kill_for_hang(self, program: str, now: float, silent_s: float, why: str) -> None:
        self.killed_for_hang.add(program)
        self.supervisor.signalProcess(f"{GROUP}:{program}", "KILL")
        event = {"time": now, "event": "hang_restart", "stage": program, "silent_s": round(silent_s, 1),
                 "why": why}
        log(self.run_dir, f"{program}: {why} for {silent_s:.0f}s (> run.hang_timeout_s={self.hang_timeout_s:g}); "
                          f"restarting it")
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")

    def clear_earlier_failure(self, now: float) -> None:
        """A new start of the run's supervisord is a new attempt: FAILED of an earlier one goes to
        events.jsonl (so `observe.report` does not call a run that then finishes failed)."""
        failed = self.run_dir / FAILED_FILE
        if failed.is_file():
            with open(self.run_dir / "events.jsonl", "a") as f:
                f.write(json.dumps({"time": now, "event": "earlier_failure", "reason": failed.read_text().strip()})
                        + "\n")
            failed.unlink()

    def end(self, reason: str) -> None:
        """Record why the run ends: FAILED for a failure (not for a refusal: the run directory may
        hold a finished run), the line on the terminal and in run_end.log."""
        self.is_ending = True
        if reason.startswith("failed"):
            (self.run_dir / FAILED_FILE).write_text(reason + "\n")
        log(self.run_dir, f"{reason}; shutting supervisord down")


def log(run_dir: Path, line: str) -> None:
    """To stderr (supervisord.conf sends the listener's to the terminal) and to <run dir>/run_end.log."""
    text = f"{time.strftime('%H:%M:%S')} run_end: {line}\n"
    sys.stderr.write(text)
    sys.stderr.flush()
    try:
        with open(run_dir / "run_end.log", "a") as f:
            f.write(text)
    except OSError:  # the run directory is gone or full: the terminal has the line
        pass
