"""Checkpoints verify against their manifest: a damaged newest one is skipped for the next older one.

Run: `pytest tests/test_checkpoint.py` (the shipped small policy, saved and damaged for real).
"""

import errno
import logging
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nano_miles.run.config import DEFAULT_POLICY_DIR

from nano_miles.run.sections import TrainerConfig
from nano_miles.stages.trainer.checkpoint import (FILES_BYTES, MANIFEST, TrainerState, checkpoint_bytes,
                                                  complete_checkpoints, load_newest, num_saves, refuse_a_short_disk,
                                                  save_checkpoint)
from nano_miles.stages.trainer.learner import Learner


def learner(model) -> Learner:
    return Learner(TrainerConfig(lr=1e-3), model, pad_id=0, temperature=1.0)


@pytest.fixture
def saved(tmp_path):
    """Checkpoints of steps 20 and 25 whose weights differ, and a fresh model to load them into."""
    model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_POLICY_DIR), dtype=torch.float32)
    optimizer = learner(model)
    root = tmp_path / "checkpoints"
    weights = {}
    for step in (20, 25):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        weights[step] = next(model.parameters()).detach().clone()
        save_checkpoint(root, model, AutoTokenizer.from_pretrained(DEFAULT_POLICY_DIR), optimizer, TrainerState(step=step, version=step, run_id="run-a",
                                                             started_at=1.0, num_trained_tokens=step * 100))
    fresh = AutoModelForCausalLM.from_pretrained(str(DEFAULT_POLICY_DIR), dtype=torch.float32)
    return root, weights, fresh, learner(fresh)


def test_an_intact_checkpoint_loads_with_all_its_state(saved):
    root, weights, model, optimizer = saved
    path, state = load_newest(root, model, optimizer)
    assert path.name == "step_000025" and state.step == 25 and state.run_id == "run-a"
    assert state.num_trained_tokens == 2500 and state.started_at == 1.0
    assert torch.equal(next(model.parameters()), weights[25])


def test_every_state_field_survives_a_save_and_evaluations_from_older_checkpoints_load():
    evaluation = {"step": 10, "elapsed_s": 3.5, "accuracy": 0.25, "reward": 0.3, "pass_at_k": None, "k": 1,
                  "parts": {"first_step": 0.4}}
    state = TrainerState(step=10, version=10, cursor=44, trained_by_step={10: ["e0-i3"]}, no_signal_ids={"e0-i9"},
                         evals=[evaluation], run_id="run-b", started_at=2.0, num_trained_tokens=7,
                         num_generated_tokens=9, split={"num_items": 50, "sha256": "ab", "settings": {"task.seed": 0}})
    assert TrainerState.from_saved(state.saved()) == state
    older = {**state.saved(), "evals": [[0, 0.125, 1.0, 0.2, None]]}  # positional, as written before
    assert TrainerState.from_saved(older).evals == [{"step": 0, "accuracy": 0.125, "elapsed_s": 1.0, "reward": 0.2,
                                                     "pass_at_k": None, "k": 0, "parts": {}}]
    del older["split"]  # written before the train split was recorded: loads, with the split unknown
    assert TrainerState.from_saved(older).split == {}


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


def test_a_checkpoint_is_a_complete_model_directory(saved):
    """from_pretrained takes it as it is: the same weights, a tokenizer that encodes as the run's does,
    the chat template and the generation config's EOS ids."""
    root, weights, _, _ = saved
    newest = root / "step_000025"
    base_tokenizer = AutoTokenizer.from_pretrained(DEFAULT_POLICY_DIR)
    tokenizer = AutoTokenizer.from_pretrained(newest)
    text = "What is (7 * 4) + 12? Put the answer in <answer></answer>.\n"
    assert tokenizer(text)["input_ids"] == base_tokenizer(text)["input_ids"] != []
    chat = [{"role": "user", "content": text}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        base_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    model = AutoModelForCausalLM.from_pretrained(newest)
    assert torch.equal(next(model.parameters()), weights[25])
    assert model.generation_config.eos_token_id == [1, 262]


def test_export_copies_one_checkpoint_without_the_trainer_files(saved, tmp_path):
    from nano_miles.export import export
    from nano_miles.run.cli import UserError

    root, weights, _, _ = saved
    run_dir = root.parent
    export(run_dir, tmp_path / "newest")
    export(run_dir, tmp_path / "older", step=20)
    assert not {"trainer_state.pt", MANIFEST} & {p.name for p in (tmp_path / "newest").iterdir()}
    for name, step in (("newest", 25), ("older", 20)):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        assert torch.equal(next(model.parameters()), weights[step]), name
        assert AutoTokenizer.from_pretrained(tmp_path / name)("12")["input_ids"] == [5 + ord("1"), 5 + ord("2")]
    with pytest.raises(UserError, match="exists and is not empty"):
        export(run_dir, tmp_path / "newest")
    with pytest.raises(UserError, match="--step 7: no checkpoint"):
        export(run_dir, tmp_path / "none", step=7)


def test_resume_from_takes_a_checkpoint_or_the_newest_good_one_of_a_run(saved):
    from nano_miles.run.cli import UserError
    from nano_miles.stages.trainer.checkpoint import find_checkpoint

    root, _, _, _ = saved
    assert find_checkpoint(root / "step_000020", "k") == root / "step_000020"
    assert find_checkpoint(root.parent, "k") == root / "step_000025"
    (root / "step_000025" / "model.safetensors").write_bytes(b"damaged")
    assert find_checkpoint(root.parent, "k") == root / "step_000020"
    with pytest.raises(UserError, match="trainer.resume_from .* neither a checkpoint"):
        find_checkpoint(root / "step_000020" / "..", "trainer.resume_from")


def older_format(checkpoint, *dropped: str) -> None:
    """Rewrite `checkpoint` as an older trainer wrote it: its state without the keys `dropped`, and a
    manifest that verifies."""
    from nano_miles.stages.trainer.checkpoint import STATE_FILE, _write_manifest

    state = torch.load(checkpoint / STATE_FILE, weights_only=True)
    torch.save({k: v for k, v in state.items() if k not in dropped}, checkpoint / STATE_FILE)
    (checkpoint / MANIFEST).unlink()
    _write_manifest(checkpoint)


# what an older trainer's checkpoint lacks, and what the one line says of it
OLDER = [
    (("lr_schedule", "no_signal_ids"),
     r"written by an older nano-miles: its trainer_state.pt has no lr_schedule, no_signal_ids; its weights alone "
     r"can start a new run: --model.path=.*step_000025$"),
    ((MANIFEST,), r"does not verify: step_000025: no readable manifest.json"),
]


@pytest.mark.parametrize("dropped, says", OLDER, ids=["no schedule state", "no manifest"])
def test_resume_from_an_older_checkpoint_is_one_line_and_leaves_the_model_alone(saved, dropped, says):
    from nano_miles.run.cli import UserError
    from nano_miles.stages.trainer.checkpoint import load_resume_from

    root, _, model, optimizer = saved
    checkpoint = root / "step_000025"
    if dropped == (MANIFEST,):
        (checkpoint / MANIFEST).unlink()
    else:
        older_format(checkpoint, *dropped)
    before = next(model.parameters()).detach().clone()
    with pytest.raises(UserError, match=rf"^trainer.resume_from '{checkpoint}'.*{says}"):
        load_resume_from(checkpoint, model, optimizer)
    assert torch.equal(next(model.parameters()), before)


def test_resume_from_another_models_checkpoint_is_one_line(saved):
    from nano_miles.run.cli import UserError
    from nano_miles.stages.trainer.checkpoint import load_resume_from

    root, _, model, optimizer = saved
    model.resize_token_embeddings(model.get_input_embeddings().num_embeddings + 8)  # another vocabulary
    with pytest.raises(UserError, match=r"^trainer.resume_from '.*step_000025' does not fit model.path \(.*shape"):
        load_resume_from(root / "step_000025", model, optimizer)


def trained_once(model) -> Learner:
    """A learner after one AdamW step, so that its two moments exist, as in every checkpoint of a run."""
    optimizer = learner(model)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 1e-3)
    optimizer.optimizer.step()
    return optimizer


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_a_checkpoint_takes_what_its_estimate_says(tmp_path, lora_rank):
    from nano_miles.stages.trainer import lora
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(str(DEFAULT_POLICY_DIR), dtype=torch.float32),
                      TrainerConfig(lora_rank=lora_rank))
    path = save_checkpoint(tmp_path, model, AutoTokenizer.from_pretrained(DEFAULT_POLICY_DIR), trained_once(model),
                           TrainerState(step=1), {"path": "base"} if lora_rank else None)
    on_disk = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    estimate = checkpoint_bytes(model)
    assert estimate - FILES_BYTES < on_disk < estimate, (estimate, on_disk)  # every tensor is counted, once


def test_the_saves_ahead_are_every_kth_step_and_the_last():
    def saves(step, num_steps, every):
        return num_saves(step, TrainerConfig(num_steps=num_steps, checkpoint_every=every))
    assert saves(0, 100, 20) == 5 and saves(0, 100, 30) == 4 and saves(40, 100, 20) == 3 and saves(45, 100, 20) == 3
    assert saves(0, 3, 0) == 1 and saves(3, 3, 0) == 0 and saves(99, 100, 20) == 1


def model_of(num_bytes: float) -> torch.nn.Module:
    """A model on the meta device whose checkpoint takes `num_bytes` (fp32 weights and AdamW's two moments,
    12 B a parameter, and FILES_BYTES): its size without its memory."""
    with torch.device("meta"):
        return torch.nn.Linear(int((num_bytes - FILES_BYTES) / 12), 1, bias=False)


def test_a_disk_too_small_for_the_checkpoints_to_come_is_refused_in_one_line(saved, tmp_path):
    from nano_miles.run.cli import UserError
    free = shutil.disk_usage(tmp_path).free
    model = model_of(free / 2.5)  # one checkpoint fits, three at once do not
    assert abs(checkpoint_bytes(model) - free / 2.5) < 12
    fresh = tmp_path / "fresh" / "checkpoints"  # not made yet: its nearest existing parent's disk counts
    assert "1 to come, 1 more at once" in refuse_a_short_disk(fresh, model, 1)
    with pytest.raises(UserError, match=rf"checkpoints need about .* GiB in {fresh} \(3 at once of .* GiB"):
        refuse_a_short_disk(fresh, model, 5)
    kept, _, _, _ = saved  # two checkpoints kept: the third is written before the oldest goes
    assert "5 to come, 1 more at once" in refuse_a_short_disk(kept, model, 5)
    with pytest.raises(UserError, match="a checkpoint needs about"):
        refuse_a_short_disk(kept, model_of(free * 2), 1)


def test_a_failed_save_leaves_no_part_and_the_older_checkpoints_as_they_were(saved):
    root, _, model, optimizer = saved

    def save(directory):
        (directory / "model.safetensors").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(root, model, AutoTokenizer.from_pretrained(DEFAULT_POLICY_DIR), optimizer,
                        TrainerState(step=30), save=save)
    assert sorted(p.name for p in root.iterdir()) == ["step_000020", "step_000025"]
    assert [p.name for p in complete_checkpoints(root)] == ["step_000020", "step_000025"]
