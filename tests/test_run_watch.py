"""The run's watch (the supervisord event listener): when a run ends, when a stage is given up on.

Run: `pytest tests/test_run_watch.py`. The hang restart itself runs under the real supervisord in
tests/test_hardening.py; here the decisions are driven event by event.
"""

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


class Exited:
    """supervisord's XML-RPC interface after the trainer exited with `status`."""

    def __init__(self, status: int):
        self.status = status

    def getProcessInfo(self, name):
        return {"name": name, "statename": "EXITED", "exitstatus": self.status}


def test_a_trainer_that_refused_to_start_ends_the_run_as_refused_not_done(tmp_path):
    exited = "processname:trainer groupname:nanomiles from_state:RUNNING expected:1 pid:3"
    assert event(RunWatch(tmp_path, 0, supervisor=Exited(0)), "PROCESS_STATE_EXITED", exited, 1.0) == "done"
    reason = event(RunWatch(tmp_path, 0, supervisor=Exited(2)), "PROCESS_STATE_EXITED", exited, 1.0)
    assert reason.startswith("refused: the trainer would not start (exit 2)") and "trainer.log" in reason
