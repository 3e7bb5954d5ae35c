"""The run's watch (the supervisord event listener): when a run ends, when a stage is given up on.

Run: `pytest tests/test_run_watch.py`. The hang restart itself runs under the real supervisord in
tests/test_hardening.py; here the decisions are driven event by event.
"""

import json
import xmlrpc.client

from nano_miles.run.watch import CRASH_WINDOW_S, MAX_QUICK_CRASHES, RunWatch, parse_payload


def event(watch: RunWatch, name: str, payload: str, now: float):
    return watch.on_event(name, parse_payload(payload), now)


def test_the_trainers_clean_exit_ends_the_run_and_fatal_fails_it(tmp_path):
    watch = RunWatch(tmp_path, hang_timeout_s=0)
    assert event(watch, "PROCESS_STATE_EXITED", "processname:trainer groupname:nanomiles from_state:RUNNING "
                 "expected:1 pid:3", 100.0) == "done"
    assert event(watch, "PROCESS_STATE_EXITED", "processname:reward expected:1 pid:3", 100.0) is None
    assert "engine" in event(watch, "PROCESS_STATE_FATAL", "processname:engine from_state:BACKOFF", 100.0)


def test_a_stage_that_keeps_crashing_soon_after_start_is_given_up_on(tmp_path):
    watch = RunWatch(tmp_path, hang_timeout_s=0)
    now = 1000.0
    for i in range(MAX_QUICK_CRASHES):
        assert event(watch, "PROCESS_STATE_STARTING", "processname:trainer", now) is None
        now += CRASH_WINDOW_S / 3  # loads its model, outlives supervisord's startsecs, then dies
        reason = event(watch, "PROCESS_STATE_EXITED", "processname:trainer expected:0 pid:7", now)
        assert (reason is None) == (i < MAX_QUICK_CRASHES - 1)
    assert reason.startswith("failed: trainer exited 5 times in a row") and "trainer.log" in reason


def test_kills_of_a_stage_that_ran_a_while_are_not_a_crash_loop(tmp_path):
    watch = RunWatch(tmp_path, hang_timeout_s=0)
    now = 1000.0
    for i in range(3 * MAX_QUICK_CRASHES):
        event(watch, "PROCESS_STATE_STARTING", "processname:reward", now)
        # every third run lasts: a run that lasted resets the count
        now += 2 * CRASH_WINDOW_S if i % 3 == 2 else 1.0
        assert event(watch, "PROCESS_STATE_EXITED", "processname:reward expected:0 pid:7", now) is None


class ShuttingDown:
    """supervisord's XML-RPC interface while it shuts down: every process call faults."""

    def getProcessInfo(self, name):
        raise xmlrpc.client.Fault(6, "SHUTDOWN_STATE")


def test_ticks_while_supervisord_shuts_down_do_not_end_the_listener(tmp_path):
    watch = RunWatch(tmp_path, hang_timeout_s=5, supervisor=ShuttingDown())
    assert event(watch, "TICK_5", "when:1000", 1000.0) is None  # the fault is logged, not raised
    watch.is_ending = True
    assert event(watch, "TICK_5", "when:1005", 1005.0) is None


def test_exits_while_supervisord_shuts_down_do_not_end_the_listener(tmp_path):
    """A stage's expected exit once the run's end is decided (or someone else stopped supervisord):
    supervisord faults on every process call then, and the listener raised it, so a refused second
    start printed a traceback after its one line."""
    exited = "processname:rollout groupname:nanomiles expected:1 pid:4"
    stopped_by_hand = RunWatch(tmp_path, 0, supervisor=ShuttingDown())
    assert event(stopped_by_hand, "PROCESS_STATE_EXITED", exited, 1.0) is None
    assert "rollout exited while supervisord shuts down (SHUTDOWN_STATE)" in (tmp_path / "run_end.log").read_text()
    ended = RunWatch(tmp_path, 0, supervisor=ShuttingDown())
    ended.end("refused: trainer would not start on the finished run")
    assert event(ended, "PROCESS_STATE_EXITED", exited, 2.0) is None
    assert event(ended, "PROCESS_STATE_FATAL", "processname:engine from_state:BACKOFF", 2.0) is None


class Exited:
    """supervisord's XML-RPC interface after a program exited with `status`."""

    def __init__(self, status: int):
        self.status = status

    def getProcessInfo(self, name):
        return {"name": name, "statename": "EXITED", "exitstatus": self.status}


TRAINER_EXITED = "processname:trainer groupname:nanomiles from_state:RUNNING expected:1 pid:3"


def test_the_trainer_done_ends_the_run_as_done(tmp_path):
    assert event(RunWatch(tmp_path, 0, supervisor=Exited(0)), "PROCESS_STATE_EXITED", TRAINER_EXITED, 1.0) == "done"


def test_any_program_that_exits_2_ends_the_run_quoting_its_last_line(tmp_path):
    """A config mistake: every stage exits 2 with the same one line; the first one ends the run (it
    was restarted forever before, and FAILED, if any, said only "see X.log")."""
    line = "rollout: unknown key(s) in [trainer]: nonexistent_key (known: num_steps, ...)"
    (tmp_path / "rollout.log").write_text("a line before\n" + line + "\n\n")
    reason = event(RunWatch(tmp_path, 0, supervisor=Exited(2)), "PROCESS_STATE_EXITED",
                   "processname:rollout groupname:nanomiles expected:1 pid:4", 1.0)
    assert reason == f"failed: rollout stopped the run (exit 2); rollout.log: {line}"
    reason = event(RunWatch(tmp_path, 0, supervisor=Exited(2)), "PROCESS_STATE_EXITED", TRAINER_EXITED, 1.0)
    assert reason == "failed: trainer stopped the run (exit 2); trainer.log: no trainer.log in the run directory"


def test_a_trainer_refusing_a_finished_run_ends_it_as_refused(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "trainer.log").write_text("trainer: ... holds the finished run abc: move it aside\n")
    reason = event(RunWatch(tmp_path, 0, supervisor=Exited(2)), "PROCESS_STATE_EXITED", TRAINER_EXITED, 1.0)
    # the trainer's own line (on the terminal, in trainer.log) says why: this one does not repeat it
    assert reason == f"refused: trainer would not start on the finished run in {tmp_path} (exit 2)"


def test_a_new_attempt_clears_an_earlier_failure(tmp_path):
    watch = RunWatch(tmp_path, hang_timeout_s=0)
    watch.end("failed: trainer exited 5 times in a row within 30s of starting; trainer.log: OSError: ...")
    assert (tmp_path / "FAILED").is_file()
    RunWatch(tmp_path, hang_timeout_s=0).clear_earlier_failure(2.0)
    assert not (tmp_path / "FAILED").exists()
    kept = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kept == [{"time": 2.0, "event": "earlier_failure",
                     "reason": "failed: trainer exited 5 times in a row within 30s of starting; trainer.log: OSError: ..."}]
    watch.end("refused: trainer.log: ...")  # a refusal leaves the directory as it is
    assert not (tmp_path / "FAILED").exists()


class Running:
    """supervisord's XML-RPC interface with every program running (pids fixed per name), recording kills."""

    def __init__(self, pids: dict[str, int]):
        self.pids, self.killed = pids, []

    def getProcessInfo(self, name):
        return {"name": name, "statename": "RUNNING", "pid": self.pids[name.split(":")[1]]}

    def signalProcess(self, name, signal):
        self.killed.append((name, signal))


def test_a_silent_engine_is_restarted_not_the_stages_waiting_for_it(tmp_path):
    """A stopped engine: the stages' calls to it block, so their loops stop beating too. Before, the
    trainer was killed (and rolled back) and the engine never restarted."""
    from nano_miles.run import liveness

    supervisor = Running({"engine": 11, "rollout": 12, "reward": 13, "trainer": 14})
    answering = {"http://e:1": True}
    watch = RunWatch(tmp_path, hang_timeout_s=10, supervisor=supervisor, engines={"engine": "http://e:1"},
                     is_answering=lambda url: answering[url])
    for stage, pid in (("rollout", 12), ("reward", 13), ("trainer", 14)):  # every stage beat at t=0
        path = liveness.heartbeat_path(tmp_path, stage)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"pid": pid, "time": 0.0, "waiting_for": "the engine"}))
    event(watch, "TICK_5", "when:0", 0.0)       # the engine answers
    answering["http://e:1"] = False             # ... then stops
    for now in (5.0, 10.0):
        event(watch, "TICK_5", "", now)
    assert supervisor.killed == []              # silent for 10 s: not more than the timeout yet
    event(watch, "TICK_5", "", 15.0)
    assert supervisor.killed == [("nanomiles:engine", "KILL")]
    restart = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["stage"], e["silent_s"]) for e in restart] == [("engine", 15.0)]
    # the restarted engine (a new pid) is judged again only once it has answered
    supervisor.pids["engine"] = 21
    event(watch, "TICK_5", "", 40.0)
    assert supervisor.killed == [("nanomiles:engine", "KILL")]
    answering["http://e:1"] = True              # it answers: the stages' silence counts from now
    event(watch, "TICK_5", "", 45.0)
    event(watch, "TICK_5", "", 55.0)            # (their calls to the engine may still be returning)
    assert supervisor.killed == [("nanomiles:engine", "KILL")]
    event(watch, "TICK_5", "", 60.0)            # still silent 15 s after the engine came back
    assert sorted(name for name, _ in supervisor.killed[1:]) == ["nanomiles:reward", "nanomiles:rollout",
                                                                 "nanomiles:trainer"]


def run_stage(tmp_path, body: str):
    """A stage's entry point whose main does `body`, under the environment supervisord gives it."""
    import os
    import subprocess
    import sys
    script = ("from nano_miles.run.cli import UserError, run\n"
              f"def main(argv):\n    {body}\n"
              "run(main, 'trainer', is_log_copied=True)\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NANOMILES_RUN_DIR": str(tmp_path)})


def test_the_trainers_last_line_ends_its_log_for_the_watch_to_quote(tmp_path):
    """The trainer's stderr goes to the terminal: a crash (a full disk during a checkpoint) or a
    mistake must also end trainer.log, or FAILED can quote nothing but "see trainer.log"."""
    crashed = run_stage(tmp_path, "raise OSError(28, 'No space left on device')")
    assert crashed.returncode == 1 and "Traceback" in crashed.stderr  # a crash keeps its traceback
    assert (tmp_path / "trainer.log").read_text() == "trainer: crashed: OSError: [Errno 28] No space left on device\n"
    watch = RunWatch(tmp_path, hang_timeout_s=0)
    for i in range(MAX_QUICK_CRASHES):
        event(watch, "PROCESS_STATE_STARTING", "processname:trainer", 10.0 * i)
        reason = event(watch, "PROCESS_STATE_EXITED", "processname:trainer expected:0 pid:7", 10.0 * i + 1)
    assert reason.endswith("trainer.log: trainer: crashed: OSError: [Errno 28] No space left on device"), reason
    mistake = run_stage(tmp_path, "raise UserError('task.test_file x.jsonl does not exist')")
    assert mistake.returncode == 2 and mistake.stderr == "trainer: task.test_file x.jsonl does not exist\n"
    assert (tmp_path / "trainer.log").read_text().splitlines()[-1] == "trainer: task.test_file x.jsonl does not exist"


def test_an_engine_that_never_answers_is_a_crash_loop_however_slow_its_start(tmp_path):
    """SGLang refusing its memory share loads its model first, so each try outlives CRASH_WINDOW_S: it was
    restarted for as long as the run lasted. Exits before the engine ever answered /health count; an
    engine that answered once and then died is not a crash on start."""
    supervisor = Running({"engine": 100, "rollout": 12, "reward": 13, "trainer": 14})
    answering = {"http://e:1": False}
    watch = RunWatch(tmp_path, hang_timeout_s=10, supervisor=supervisor, engines={"engine": "http://e:1"},
                     is_answering=lambda url: answering[url])
    (tmp_path / "engine.log").write_text("ValueError: Raise --mem-fraction-static above 0.112\n")

    def one_life(pid: int, start: float, answers: bool) -> str | None:
        supervisor.pids["engine"] = pid
        event(watch, "PROCESS_STATE_STARTING", "processname:engine", start)
        answering["http://e:1"] = answers
        for t in range(5, 45, 5):  # it loads for 45 s, the watch asking each tick
            event(watch, "TICK_5", "", start + t)
        return event(watch, "PROCESS_STATE_EXITED", f"processname:engine expected:0 pid:{pid}", start + 45)
    assert [one_life(100 + i, 50.0 * i, answers=False) for i in range(MAX_QUICK_CRASHES - 1)] == [None] * 4
    assert one_life(200, 500.0, answers=True) is None  # it served a while: the count starts again
    reasons = [one_life(300 + i, 600.0 + 50 * i, answers=False) for i in range(MAX_QUICK_CRASHES)]
    assert reasons[:-1] == [None] * 4 and reasons[-1] == (
        "failed: engine exited 5 times in a row before it answered /health; "
        "engine.log: ValueError: Raise --mem-fraction-static above 0.112")
    assert supervisor.killed == []  # a loading engine is never taken for a hung one
    unasked = RunWatch(tmp_path, hang_timeout_s=0, engines={"engine": "http://e:1"})
    for i in range(2 * MAX_QUICK_CRASHES):  # without the ticks' questions, slow exits are not counted
        event(unasked, "PROCESS_STATE_STARTING", "processname:engine", 50.0 * i)
        assert event(unasked, "PROCESS_STATE_EXITED", f"processname:engine expected:0 pid:{i}", 50.0 * i + 45) is None


def test_a_trainer_that_dies_before_each_first_step_is_a_crash_loop(tmp_path):
    """A trainer out of memory in its first step dies after loading, past CRASH_WINDOW_S, and was restarted
    for as long as the run lasted. Exits before a step's line reaches metrics.jsonl count; a life that
    finished a step starts the count again."""
    watch = RunWatch(tmp_path, hang_timeout_s=0)
    (tmp_path / "trainer.log").write_text("trainer: crashed: OutOfMemoryError: CUDA out of memory.\n")

    def one_life(start: float, steps: int) -> str | None:
        event(watch, "PROCESS_STATE_STARTING", "processname:trainer", start)
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1))
        return event(watch, "PROCESS_STATE_EXITED", "processname:trainer expected:0 pid:7", start + 38)
    assert [one_life(40.0 * i, steps=0) for i in range(MAX_QUICK_CRASHES - 1)] == [None] * 4
    assert one_life(200.0, steps=1) is None
    reasons = [one_life(300.0 + 40 * i, steps=0) for i in range(MAX_QUICK_CRASHES)]
    assert reasons[:-1] == [None] * 4 and reasons[-1] == (
        "failed: trainer exited 5 times in a row without training past step 1; "
        "trainer.log: trainer: crashed: OutOfMemoryError: CUDA out of memory.")
    (tmp_path / "metrics.jsonl").unlink()
    watch = RunWatch(tmp_path, hang_timeout_s=0)  # a run whose trainer never finished a step
    assert [one_life(40.0 * i, steps=0) for i in range(MAX_QUICK_CRASHES)][-1] == (
        "failed: trainer exited 5 times in a row before it finished a step; "
        "trainer.log: trainer: crashed: OutOfMemoryError: CUDA out of memory.")
    for start in range(1000, 1000 + 80 * MAX_QUICK_CRASHES, 40):  # the rollout stage has no steps of its own
        event(watch, "PROCESS_STATE_STARTING", "processname:rollout", start)
        assert event(watch, "PROCESS_STATE_EXITED", "processname:rollout expected:0 pid:8", start + 38) is None


def test_a_trainer_that_dies_at_the_same_step_after_each_restart_is_a_crash_loop(tmp_path):
    """A 3B trainer whose final checkpoint did not fit on the disk resumed from step 0 and trained its three
    steps again, after each start. An exit counts when the trainer trained no step past the furthest one
    in metrics.jsonl; a life that got further starts the count again, and a cut last line is no step."""
    watch = RunWatch(tmp_path, hang_timeout_s=0)
    (tmp_path / "trainer.log").write_text("trainer: crashed: OSError: [Errno 28] No space left on device\n")

    def one_life(start: float, steps: range, stage: str = "trainer") -> str | None:
        event(watch, "PROCESS_STATE_STARTING", f"processname:{stage}", start)
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps({"step": s}) + "\n" for s in steps)
            f.write('{"step": 9')  # its last line, cut short by the exit
        return event(watch, "PROCESS_STATE_EXITED", f"processname:{stage} expected:0 pid:7", start + 90)
    assert one_life(0.0, range(1, 4)) is None  # steps 1-3: the furthest so far
    assert [one_life(100.0 * i, range(1, 4)) for i in range(1, MAX_QUICK_CRASHES)] == [None] * 4
    assert one_life(500.0, range(1, 5)) is None  # step 4: further, the count starts again
    assert one_life(600.0, range(3, 5), stage="rollout") is None  # another stage's exit reads no steps
    reasons = [one_life(700.0 + 100 * i, range(3, 5)) for i in range(MAX_QUICK_CRASHES)]
    assert reasons[:-1] == [None] * 4 and reasons[-1] == (
        "failed: trainer exited 5 times in a row without training past step 4; "
        "trainer.log: trainer: crashed: OSError: [Errno 28] No space left on device")
