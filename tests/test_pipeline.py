"""The whole pipeline under the real supervisord: sync GRPO learns, versions and staleness hold,
and the stages may be started in any order."""

import json
import time

import pytest

from harness.learning_runs import SYNC, margin
from harness.supervised_run import SupervisedRun

ORDER = ["--trainer.num_steps=3", "--trainer.batch_groups=4", "--rollout.group_size=4",
         "--trainer.eval_every=0", "--task.num_test=10"]


@pytest.fixture
def supervised(tmp_path):
    runs = []

    def make(overrides, **kw):
        run = SupervisedRun(tmp_path / f"run{len(runs)}", overrides, **kw)
        runs.append(run)
        return run
    yield make
    for run in runs:
        run.stop()


@pytest.mark.slow
def test_sync_run_learns_and_ends_by_itself(supervised):
    run = supervised(SYNC).start()
    assert run.wait(timeout_s=900) == 0, run.tail()
    assert not (run.run_dir / "FAILED").exists()
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(1, 49))
    assert all(r["version"] == r["step"] for r in records), "engine weights must follow every step"
    assert all(r["staleness_max"] == 0 for r in records), "sync mode trains only on-policy samples"
    assert all(r["parity"] < 1e-4 for r in records), "engine and trainer logprobs disagree"
    ids = [g for r in records for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == 48 * 16, "every group is trained exactly once"
    s = run.summary()
    # half the smallest gain of five seeds (bench/results/learning_seeds.json), not one lucky run. The
    # training reward (early vs late fifth of 48 steps, new prompts every step) moved by -0.018 to
    # +0.007 over those seeds: noise at this length, so it is not asserted; held-out accuracy is.
    assert s["eval_accuracy_max"] - s["eval_accuracy_start"] >= margin("sync", "eval_gain"), s
    assert s["ledger"]["num_lost"] == 0 and s["ledger"]["num_trained_twice"] == 0
    assert (run.run_dir / "checkpoints" / "step_000048" / "model.safetensors").exists()
    assert "trainer (exit status 0; expected)" in (run.run_dir / "supervisord.log").read_text()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """A short run with every stage started at once by supervisord."""
    run = SupervisedRun(tmp_path_factory.mktemp("reference"), ORDER).start()
    try:
        assert run.wait(timeout_s=300) == 0, run.tail()
        yield run
    finally:
        run.stop()


@pytest.mark.slow
@pytest.mark.parametrize("order", [("trainer", "rollout", "reward", "engine"),
                                   ("reward", "engine", "trainer", "rollout")])
def test_start_order_does_not_matter(supervised, reference_run, order):
    run = supervised(ORDER, is_autostart=False).start()
    run.wait_for_socket()
    for stage in order:
        out = run.ctl("start", f"nanomiles:{stage}")
        assert "started" in out, out
        time.sleep(1.0)  # let the earlier stage get ahead: the others must wait for it, not fail
    assert run.wait(timeout_s=300) == 0, run.tail()
    got, want = run.metrics(), reference_run.metrics()
    assert [sorted(r["group_ids"]) for r in got] == [sorted(r["group_ids"]) for r in want]
    assert [r["version"] for r in got] == [1, 2, 3]


@pytest.mark.slow
def test_a_second_supervisord_on_a_finished_run_refuses_in_one_line(reference_run):
    """`supervisord -c supervisord.conf` again on a run directory whose run finished: the trainer says
    so in one line and the run ends at once, touching nothing of the finished run."""
    run_dir = reference_run.run_dir
    before = {name: (run_dir / name).read_text() for name in ("summary.json", "metrics.jsonl", "run.json")}
    again = SupervisedRun(run_dir, ORDER).start()
    try:
        assert again.wait(timeout_s=120) == 0, again.tail()
    finally:
        again.stop()
    output = again.output.read_text()
    said = [line for line in output.splitlines() if "holds the finished run" in line]
    run_id = json.loads(before["run.json"])["run_id"]
    assert len(said) == 1 and run_id in said[0] and "move it aside" in said[0], output
    assert "Traceback" not in output and not (run_dir / "FAILED").exists()
    assert {name: (run_dir / name).read_text() for name in before} == before
