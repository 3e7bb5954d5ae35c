"""Checkpoints verify against their manifest: a damaged newest one is skipped for the next older one.

Run: `pytest tests/test_checkpoint.py` (the shipped small policy, saved and damaged for real).
"""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from nano_miles.run.config import DEFAULT_POLICY_DIR
from nano_miles.stages.trainer.checkpoint import (MANIFEST, TrainerState, complete_checkpoints, load_newest,
                                                  save_checkpoint)


@pytest.fixture
def saved(tmp_path):
    """Checkpoints of steps 20 and 25 whose weights differ, and a fresh model to load them into."""
    model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_POLICY_DIR), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = tmp_path / "checkpoints"
    weights = {}
    for step in (20, 25):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        weights[step] = next(model.parameters()).detach().clone()
        save_checkpoint(root, model, optimizer, TrainerState(step=step, version=step, run_id="run-a",
                                                             started_at=1.0, num_trained_tokens=step * 100))
    fresh = AutoModelForCausalLM.from_pretrained(str(DEFAULT_POLICY_DIR), dtype=torch.float32)
    return root, weights, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3)


def test_an_intact_checkpoint_loads_with_all_its_state(saved):
    root, weights, model, optimizer = saved
    path, state = load_newest(root, model, optimizer)
    assert path.name == "step_000025" and state.step == 25 and state.run_id == "run-a"
    assert state.num_trained_tokens == 2500 and state.started_at == 1.0
    assert torch.equal(next(model.parameters()), weights[25])


@pytest.mark.parametrize("damage", ["truncate every file", "flip one byte", "no manifest"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(saved, damage, caplog):
    root, weights, model, optimizer = saved
    newest = root / "step_000025"
    if damage == "truncate every file":
        for f in newest.iterdir():
            if f.name != MANIFEST:
                f.write_bytes(f.read_bytes()[:10])
    elif damage == "flip one byte":  # same size: only the checksum tells
        f = newest / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        (newest / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        path, state = load_newest(root, model, optimizer)
    assert path.name == "step_000020" and state.step == 20
    assert torch.equal(next(model.parameters()), weights[20])
    assert any("step_000025" in r.getMessage() for r in caplog.records), caplog.text


def test_nothing_usable_means_a_fresh_start(saved):
    root, _, model, optimizer = saved
    for d in complete_checkpoints(root):
        (d / "trainer_state.pt").write_bytes(b"")
    assert complete_checkpoints(root) == [] and load_newest(root, model, optimizer) is None
