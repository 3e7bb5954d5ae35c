"""TRL's GRPOTrainer on a nano-miles config (harness/trl_grpo.py, what bench/vs_trl.py compares with).
Run: pytest tests/test_vs_trl.py

A real TRL run on the CPU with the small policy: the settings read back from TRL's built trainer
equal nano-miles' own on every key that must match, and the run records what the bench reads.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("trl")

OVERRIDES = ["--trainer.batch_groups=2", "--rollout.group_size=4", "--task.num_test=8",
             "--trainer.lr=3e-4", "--rollout.max_new_tokens=24", "--run.seed=3"]


@pytest.mark.parametrize("num_steps, eval_every, evaluated", [
    (2, 1, [0, 1, 2]),  # before training and after every step
    (3, 0, [0, 3]),     # 0: as nano-miles' trainer, before training and after the last step only
])
def test_trl_runs_what_the_nano_miles_config_says(tmp_path, num_steps, eval_every, evaluated):
    from harness.trl_grpo import MUST_MATCH, nano_settings
    from nano_miles.run.config import load_config
    out = tmp_path / "trl.json"
    overrides = OVERRIDES + [f"--trainer.num_steps={num_steps}", f"--trainer.eval_every={eval_every}"]
    done = subprocess.run([sys.executable, "-m", "harness.trl_grpo", "--out", str(out), *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    nano = nano_settings(load_config(overrides=overrides))
    assert {k: result["settings"][k] for k in MUST_MATCH} == {k: nano[k] for k in MUST_MATCH}
    assert [s["step"] for s in result["steps"]] == list(range(1, num_steps + 1))
    assert all(s["num_samples"] == 8 and 0 < s["num_tokens"] <= 8 * 24 for s in result["steps"])
    assert all(s["phase_s"]["generate"] > 0 and s["phase_s"]["train"] > 0 for s in result["steps"])
    assert [e["step"] for e in result["evals"]] == evaluated
    # a line a step as it ends: what the bench's trl.log keeps of a run its time limit cuts short
    progress = [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("step ") and "/" in line]
    assert progress == [f"step {k}/{num_steps}" for k in range(1, num_steps + 1)]
    assert result["evals"][0]["elapsed_s"] == 0.0 and result["train_s"] >= result["evals"][-1]["elapsed_s"] > 0


def test_a_bad_flag_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "harness.trl_grpo", "--out", str(tmp_path / "x.json"),
                           "--generation", "vllm"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--generation" in done.stderr and "Traceback" not in done.stderr


def test_the_bench_names_its_sections_by_policy_shape_or_model(monkeypatch):
    import argparse

    from nano_miles.run.cli import UserError
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import vs_trl
    args = lambda **kw: argparse.Namespace(**{"policies": "medium,large", "shapes": "", "model": None,  # noqa: E731
                                              "models": REPO / "runs" / "shapes", **kw})
    policies = vs_trl.entries(args())
    assert [(e.name, e.speed_targets, e.target_points) for e in policies] == [("medium", (1.0, 1.0), 8.0),
                                                                              ("large", (1.0, 3.0), 50.0)]
    assert vs_trl.title("large") == "large policy"
    shapes = vs_trl.entries(args(shapes="0.5b,1.5b"))
    assert [e.name for e in shapes] == ["Qwen2.5-0.5b shape", "Qwen2.5-1.5b shape"]
    assert all(e.target_points is None and e.speed_targets == vs_trl.SHAPE_TARGETS for e in shapes)
    assert f"--model.path={REPO / 'runs' / 'shapes' / '1.5b'}" in shapes[1].overrides
    assert all(e.overrides[-len(vs_trl.SHAPE_OVERRIDES):] == vs_trl.SHAPE_OVERRIDES for e in shapes)
    assert vs_trl.title(shapes[0].name) == "Qwen2.5-0.5b shape"
    (model,) = vs_trl.entries(args(shapes="0.5b", model=REPO / "runs" / "my-model"))  # --model wins
    assert model.name == "my-model" and model.overrides[0] == f"--model.path={REPO / 'runs' / 'my-model'}"
    with pytest.raises(UserError, match="--shapes takes names from 0.5b, 1.5b, 3b, 7b, not 2b"):
        vs_trl.entries(args(shapes="2b"))


def test_runs_of_two_benches_are_compared_only_when_they_make_one_comparison(tmp_path, monkeypatch):
    """`--runs` splits a comparison over two benches on one machine; `--from` joins the runs of a policy
    made with the same settings on the same device, each once (a cut-short bench's finished runs too), and
    refuses anything else in one line."""
    from nano_miles.run.cli import UserError
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import vs_trl

    def result(name, runs, complete=True, device="NVIDIA H100 80GB HBM3", overrides=("--trainer.num_steps=6",)):
        policy = {"config": "configs/gpu_large.toml", "overrides": list(overrides), "target_points": None,
                  "device": device, "runs": {r: {"name": r} for r in runs}}
        (tmp_path / name).write_text(json.dumps({"complete": complete, "policies": {"0.5b": policy}}))
        return tmp_path / name
    nano, trl = result("nano.json", ["sync", "async"]), result("trl.json", ["trl"])
    assert list(vs_trl.merged([nano, trl])["0.5b"]["runs"]) == ["sync", "async", "trl"]
    # a bench cut short keeps the runs it finished; another bench makes the one it did not
    cut, rest = result("cut.json", ["sync"], complete=False), result("rest.json", ["async"])
    assert sorted(vs_trl.merged([cut, rest, trl])["0.5b"]["runs"]) == ["async", "sync", "trl"]
    refusals = [("no file holds the trl run of 0.5b", [nano]),
                ("0.5b has its async, sync run in an earlier file too", [nano, nano]),
                ("other settings or another device", [nano, result("h200.json", ["trl"], device="NVIDIA H200")]),
                ("other settings or another device", [nano, result("8.json", ["trl"], overrides=["--trainer.num_steps=8"])]),
                ("no file holds the async run of 0.5b", [cut, trl])]
    for says, files in refusals:
        with pytest.raises(UserError, match=says):
            vs_trl.merged(files)
