"""Two SGLang engines on one GPU behind sglang-router under the real supervisord: the trainer pushes
through the flat buffer to both, a replica killed with kill -9 comes back, maps the buffer anew, and
nothing is lost. Skipped where there is no CUDA device, no sglang or no sglang-router.
Run on a GPU host: python -m pytest -m gpu tests/test_gpu_replicas.py -s
"""

import json

import pytest

from conftest import GPU_ONLY, report

pytestmark = GPU_ONLY
NUM_STEPS = 12


@pytest.mark.slow
def test_two_sglang_replicas_survive_kill_9(tmp_path):
    pytest.importorskip("sglang_router")
    from harness.servers import SGLANG_EXTRA_ARGS
    from harness.supervised_run import SupervisedRun

    run = SupervisedRun(tmp_path / "run", [
        "--engine.kind=sglang", "--engine.replicas=2", "--engine.dtype=bfloat16",
        "--engine.mem_fraction_static=0.15", f"--engine.extra_args='{SGLANG_EXTRA_ARGS}'",
        "--run.pause_mode=in_place", "--trainer.device=cuda", f"--trainer.num_steps={NUM_STEPS}",
        "--trainer.batch_groups=8", "--rollout.group_size=4", "--trainer.eval_every=0",
        "--task.num_test=20", "--trainer.checkpoint_every=4"]).start()
    try:
        run.wait_for_step(3, timeout_s=420)
        run.kill("engine_1")
        assert run.wait(timeout_s=480) == 0, run.tail()
    finally:
        run.stop()
    summary = run.summary()
    report("replicas_summary", summary)
    ledger = json.loads((run.run_dir / "ledger.json").read_text())
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0, ledger
    assert ledger["num_trained_once"] == NUM_STEPS * 8
    assert sorted(run.steps()) == list(range(1, NUM_STEPS + 1))
    assert summary["weight_transport"] == "flat", "both engines load the flat buffer: the trainer must use it"
    assert summary["engine_final_version"] == str(NUM_STEPS), "the replicas disagree or lag"
    assert "exited: engine_1 (terminated by SIGKILL" in (run.run_dir / "supervisord.log").read_text()
