"""Two engines behind sglang-router under the real supervisord (`engine.replicas = 2`): generation is
spread over both, every weight update and pause reaches each, and killing one replica or the router
loses nothing. The router is the Rust sglang-router, which runs on CPU; skipped if not installed.
"""

import json
import re

import pytest

from conftest import FINAL_PARITY
from harness.supervised_run import SupervisedRun

pytest.importorskip("sglang_router")

NUM_STEPS = 16
REPLICAS = ["--engine.replicas=2", f"--trainer.num_steps={NUM_STEPS}", "--trainer.batch_groups=8",
            "--rollout.group_size=4", "--trainer.eval_every=0", "--task.num_test=10",
            "--trainer.checkpoint_every=4", "--trainer.control_timeout_s=2", "--trainer.control_retries=2"]


def served_versions(log_text: str) -> list[int]:
    """The weight versions an engine's log says it loaded, in order."""
    return [int(v) for v in re.findall(r"weights updated: .* weight_version=(\d+)", log_text)]


@pytest.mark.slow
def test_two_replicas_behind_the_router_survive_kill_9(tmp_path):
    run = SupervisedRun(tmp_path / "run", REPLICAS).start()
    try:
        run.wait_for_step(3)
        killed = [run.kill("engine_1"), run.kill("router")]
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        run.stop()
    summary = run.summary()
    ledger = json.loads((run.run_dir / "ledger.json").read_text())
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0, ledger
    assert ledger["num_trained_once"] == NUM_STEPS * 8
    assert sorted(run.steps()) == list(range(1, NUM_STEPS + 1))
    assert summary["engine_final_version"] == str(NUM_STEPS), "the replicas disagree or lag"
    assert summary["final_parity"] <= FINAL_PARITY
    supervisord_log = (run.run_dir / "supervisord.log").read_text()
    for name in ("engine_1", "router"):
        assert f"exited: {name} (terminated by SIGKILL" in supervisord_log, name
    for name in ("engine_2", "engine_3"):  # unused slots say so and stay down
        assert "is not used: engine.replicas = 2" in (run.run_dir / f"{name}.log").read_text()
        assert f"exited: {name} (exit status 0; expected)" in supervisord_log
    logs = {name: (run.run_dir / f"{name}.log").read_text() for name in ("engine", "engine_1")}
    for name, text in logs.items():  # engine_1's log runs on across its restart
        assert served_versions(text)[-1] == NUM_STEPS, f"{name} does not serve the final weights"
        assert "generation paused" in text, f"{name} was never paused for an update"
    (tmp_path / "kills.json").write_text(json.dumps(killed, default=str))
