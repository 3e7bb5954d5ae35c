"""The scale bench at Qwen2.5-0.5B's shape (random weights): the whole pipeline, sync and async, under the
real supervisord beside SGLang with the memory plan on; a few steps each. It keeps the real-size path
working: the shape is built, SGLang alone and both modes finish every step with a weight update each,
and the trainer's peak stays under what the memory plan budgeted for it.

Run on a GPU host: python -m pytest -m gpu tests/test_gpu_scale.py -s   (NANOMILES_SHAPES=DIR keeps the
built model between runs)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPU_ONLY, report
from harness.servers import REPO_ROOT

pytestmark = GPU_ONLY


@pytest.mark.slow
def test_the_pipeline_runs_sync_and_async_at_the_0_5b_shape(tmp_path):
    import torch

    from nano_miles.run.config import load_config
    from nano_miles.stages.trainer import memory_plan
    models = Path(os.environ.get("NANOMILES_SHAPES", tmp_path / "shapes"))
    steps = 4
    done = subprocess.run([sys.executable, "bench/scale.py", "--shapes", "0.5b", "--steps", str(steps),
                           "--models", str(models), "--out", str(tmp_path), "--name", "scale"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shape = json.loads((tmp_path / "scale.json").read_text())["shapes"][0]
    report("scale_0.5b", shape)
    runs = {r["mode"]: r for r in shape["runs"]}
    assert set(runs) == {"sync", "async"}
    for r in runs.values():
        assert r["num_timed_steps"] >= steps - 2  # every step but the first and the evaluating last one
        assert 0 < r["update_ms"] < 1000 and r["train_tokens_per_s"] > 0
    assert 0 < runs["sync"]["loop_generation_tokens_per_s"] and shape["standalone"]["tokens_per_s"] > 0
    cfg = load_config(REPO_ROOT / "configs/gsm8k_qwen.toml", overrides=[f"--model.path={models / '0.5b'}"])
    chosen = memory_plan.plan_for(cfg, torch.cuda.get_device_properties(0).total_memory)
    assert max(r["trainer_peak_gb"] for r in runs.values()) <= chosen.peak_gib, (chosen, runs)
