"""A bench's result file after every finished run: a bench cut short leaves valid JSON with what it finished;
a bench killed leaves no process of its runs behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness.result_file import write_result
from harness.servers import REPO_ROOT
from nano_miles.run.process import processes_of_run


def bench(path, num_runs: int, fail_at: int | None = None) -> None:
    """The shape of every bench loop: a run, its row written; after the last, the aggregates."""
    rows = []
    for i in range(num_runs):
        if i == fail_at:
            raise RuntimeError(f"run {i} crashed")
        rows.append({"run": i, "seconds": 1.5 * i})
        write_result(path, {"rows": rows}, is_complete=False)
    write_result(path, {"rows": rows, "mean_seconds": sum(r["seconds"] for r in rows) / len(rows)}, is_complete=True)


def test_a_bench_cut_short_keeps_the_runs_it_finished(tmp_path):
    path = tmp_path / "results" / "bench.json"  # its folder made on the first write
    with pytest.raises(RuntimeError):
        bench(path, num_runs=3, fail_at=2)
    result = json.loads(path.read_text())
    assert result == {"complete": False, "rows": [{"run": 0, "seconds": 0.0}, {"run": 1, "seconds": 1.5}]}
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]  # no temporary file left behind


def test_a_finished_bench_says_complete_with_its_aggregates(tmp_path):
    path = tmp_path / "bench.json"
    bench(path, num_runs=3)
    result = json.loads(path.read_text())
    assert result["complete"] is True and result["mean_seconds"] == 1.5 and len(result["rows"]) == 3


def test_a_result_that_does_not_encode_leaves_the_last_file_whole(tmp_path):
    path = tmp_path / "bench.json"
    write_result(path, {"rows": [1]}, is_complete=False)
    with pytest.raises(TypeError):
        write_result(path, {"rows": [1, object()]}, is_complete=False)
    assert json.loads(path.read_text()) == {"complete": False, "rows": [1]}
    with pytest.raises(ValueError):  # the flag is write_result's: a result may not carry its own
        write_result(path, {"complete": True}, is_complete=False)


def test_the_tests_margins_refuse_seeds_a_bench_cut_short_left(tmp_path, monkeypatch):
    from harness import learning_runs
    runs = [{"seed": 0, "eval_gain": 0.1, "reward_gain": 0.2}]
    monkeypatch.setattr(learning_runs, "RESULTS", tmp_path / "learning_seeds.json")
    write_result(learning_runs.RESULTS, {"configs": {"sync": {"runs": runs}}}, is_complete=False)
    with pytest.raises(AssertionError, match="unfinished"):
        learning_runs.margin("sync", "eval_gain")
    write_result(learning_runs.RESULTS, {"configs": {"sync": {"runs": runs}}}, is_complete=True)
    assert learning_runs.margin("sync", "eval_gain") == 0.05


def test_quoted_figures_come_from_finished_benches_or_ones_quoted_as_cut_short(tmp_path, monkeypatch):
    import test_quoted_figures as quoted
    monkeypatch.setattr(quoted, "RESULTS", tmp_path)
    rows = [{"shape": "policy", "num_params": 812_000}]
    write_result(tmp_path / quoted.WS_CPU, {"rows": rows}, is_complete=False)
    num_params = quoted.F(quoted.WS_CPU, quoted.ws_rows, {"shape": "policy"}, "num_params")
    with pytest.raises(AssertionError, match="unfinished"):
        quoted.resolve(num_params)
    write_result(tmp_path / quoted.WS_CPU, {"rows": rows}, is_complete=True)
    assert quoted.resolve(num_params) == 812_000
    # one the docs quote as a cut-short bench's: quotable while it is one, and only then
    monkeypatch.setattr(quoted, "CUT_SHORT", {quoted.WS_CPU})
    with pytest.raises(AssertionError, match="not cut short"):
        quoted.resolve(num_params)
    write_result(tmp_path / quoted.WS_CPU, {"rows": rows}, is_complete=False)
    assert quoted.resolve(num_params) == 812_000


def test_a_bench_killed_with_sigterm_stops_the_run_it_started(tmp_path):
    """supervisord runs in a session of its own, so `timeout` or `kill` on a bench never reaches it: the
    bench must stop it on its way out (on a GPU a leftover run holds the memory the next one needs)."""
    run_dir = tmp_path / "run"
    bench_like = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from harness.supervised_run import SupervisedRun
        run = SupervisedRun(Path({str(run_dir)!r}), ["--trainer.num_steps=1000"]).start()
        try:
            run.wait_for_socket()
            print(run.proc.pid, flush=True)
            time.sleep(600)
        finally:
            run.stop()
    """)
    proc = subprocess.Popen([sys.executable, "-c", bench_like], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        supervisord = int(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while not processes_of_run(run_dir):  # the stages are up: there is something to leave behind
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    with pytest.raises(ProcessLookupError):
        os.kill(supervisord, 0)
    assert processes_of_run(run_dir) == {}
