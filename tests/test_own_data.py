"""A user's own data end to end, under the real supervisord: a JSONL file of word problems, the chat
template, the math reward, held-out pass@k, samples.jsonl, checkpoints that load anywhere, and a run
continued from another run's checkpoint (`trainer.resume_from`).
Run: pytest tests/test_own_data.py
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.servers import REPO_ROOT
from harness.supervised_run import SupervisedRun
from nano_miles.observe.run_record import read_jsonl

DATA = REPO_ROOT / "examples" / "word_problems"
NUM_STEPS = 4
OWN_DATA = ["--task.name=nano_miles.tasks.files", f"--task.train_file={DATA / 'train.jsonl'}",
            f"--task.test_file={DATA / 'test.jsonl'}", "--task.prompt_key=question", "--task.label_key=answer",
            "--task.chat_template=true", "--task.num_test=16", "--reward.fn=nano_miles.rewards.math:reward",
            "--trainer.batch_groups=4", "--rollout.group_size=4", "--rollout.max_new_tokens=32",
            "--trainer.eval_every=0", "--trainer.eval_samples=2", "--trainer.checkpoint_every=2",
            "--metrics.save_rollouts=true", "--metrics.samples_per_step=3"]


@pytest.fixture(scope="module")
def own_data_run(tmp_path_factory):
    run = SupervisedRun(tmp_path_factory.mktemp("own-data"), OWN_DATA + [f"--trainer.num_steps={NUM_STEPS}"]).start()
    try:
        assert run.wait(timeout_s=600) == 0, run.tail()
        yield run
    finally:
        run.stop()


@pytest.mark.slow
def test_a_run_on_a_jsonl_file_with_the_chat_template_and_the_math_reward(own_data_run):
    run = own_data_run
    summary = run.summary()
    assert summary["num_steps"] == NUM_STEPS and not (run.run_dir / "FAILED").exists()
    assert summary["ledger"]["num_lost"] == 0 and summary["ledger"]["num_trained_twice"] == 0
    assert summary["ledger"]["num_trained_once"] == NUM_STEPS * 4
    start, end = summary["evals"][0], summary["evals"][-1]
    assert start["step"] == 0 and end["step"] == NUM_STEPS
    assert all(0 <= e["accuracy"] <= 1 and 0 <= e["reward"] <= 1 and 0 <= e["pass_at_k"] <= 1 for e in (start, end)), \
        "held-out greedy accuracy, mean reward and pass@2 of the math reward are shares"
    records = run.metrics()
    assert {"format", "accuracy"} <= set(records[-1]) and records[-1]["eval_pass_at_k"] is not None

    questions = {json.loads(line)["question"]: json.loads(line)["answer"]
                 for line in (DATA / "train.jsonl").read_text().splitlines()}
    samples = read_jsonl(run.run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [step for step in range(1, NUM_STEPS + 1) for _ in range(3)]
    for s in samples:  # the prompt exactly as sent: the template around a question of the file
        assert s["prompt"].startswith("<|im_start|>user\n") and s["prompt"].endswith("<|im_start|>assistant\n")
        question = s["prompt"].removeprefix("<|im_start|>user\n").removesuffix("<|im_end|>\n<|im_start|>assistant\n")
        assert questions[question] == s["label"]
        assert s["num_response_tokens"] > 0 and set(s["reward_parts"]) == {"accuracy", "format"}
        assert s["version"] == s["step"] - 1  # sync: sampled on the weights of the step before

    # the final checkpoint is a whole model directory: it loads and encodes as the run did
    checkpoint = run.run_dir / "checkpoints" / f"step_{NUM_STEPS:06d}"
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    rollout = read_jsonl(run.run_dir / "rollouts.jsonl")[0]
    question = next(s for s in samples if s["group_id"] == rollout["group_id"])["prompt"]
    chat = [{"role": "user", "content": question.removeprefix("<|im_start|>user\n").split("<|im_end|>")[0]}]
    ids = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]
    assert ids == rollout["prompt_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([ids])).logits).all()


@pytest.mark.slow
def test_a_run_continues_from_another_runs_checkpoint(own_data_run, tmp_path):
    first = own_data_run
    checkpoint = first.run_dir / "checkpoints" / "step_000002"
    run = SupervisedRun(tmp_path / "continued", OWN_DATA + [f"--trainer.num_steps={NUM_STEPS}",
                                                            f"--trainer.resume_from={checkpoint}",
                                                            "--trainer.eval_samples=1"]).start()
    try:
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        run.stop()
    assert [r["step"] for r in run.metrics()] == [3, 4], "steps 1-2 came from the checkpoint"
    assert json.loads((run.run_dir / "run.json").read_text())["run_id"] == \
        json.loads((first.run_dir / "run.json").read_text())["run_id"]
    ledger = run.summary()["ledger"]
    assert ledger["num_trained_once"] == NUM_STEPS * 4 and ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0
    assert "resuming run" in (run.run_dir / "trainer.log").read_text()
