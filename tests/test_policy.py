"""Tests of the shipped small policy: loads as a plain HF Qwen2 model, tokenizer round-trips, learns a little.
Run: pytest tests/test_policy.py
"""

import inspect
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from nano_miles.policy.evaluate import MAX_NEW_TOKENS, evaluate_model
from nano_miles.policy.formats import encode_prompt
from nano_miles.tasks.arithmetic import make_expressions, make_problems, reward

MAX_SIZE_BYTES = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def model(policy_dir):
    return AutoModelForCausalLM.from_pretrained(policy_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(policy_dir):
    return AutoTokenizer.from_pretrained(policy_dir)


def test_is_a_small_tied_fp32_qwen2(policy_dir, model):
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with safe_open(policy_dir / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        assert all(f.get_slice(n).get_dtype() == "F32" for n in names)
    assert "lm_head.weight" not in names  # tied: stored once, as the embedding
    assert sum(p.stat().st_size for p in policy_dir.iterdir()) < MAX_SIZE_BYTES


def test_config_and_tokenizer_agree_on_special_ids(policy_dir, model, tokenizer):
    config = json.loads((policy_dir / "config.json").read_text())
    assert isinstance(config["eos_token_id"], int)
    assert config["eos_token_id"] == tokenizer.eos_token_id == model.config.eos_token_id
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert config["vocab_size"] == len(tokenizer)


def test_tokenizer_round_trips_task_strings(tokenizer):
    problems = make_problems("test", 20)
    strings = [p.prompt for p in problems] + [e.worked_response() for e in make_expressions("train", 20)]
    strings += ["<answer> -12 </answer>", "  a  b\n\n\t", "<answer>1</answer><answer>", "naïve → ok"]
    for s in strings:
        ids = tokenizer(s, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == s
        assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == s
    # The answer tags are single tokens; ASCII is one token per character.
    assert len(tokenizer("<answer>87</answer>", add_special_tokens=False)["input_ids"]) == 4
    assert len(tokenizer("(7 * 4) + 12", add_special_tokens=False)["input_ids"]) == len("(7 * 4) + 12")


def test_encode_prompt_adds_nothing(tokenizer):
    problem = make_problems("test", 1)[0]
    ids = encode_prompt(tokenizer, problem)
    assert tokenizer.decode(ids) == problem.prompt
    assert tokenizer.eos_token_id not in ids and tokenizer.pad_token_id not in ids


def greedy_scores(model, tokenizer, problems) -> tuple[float, float]:
    """Greedy accuracy and format rate, decoded here without `generate`: argmax step by step over the
    model's KV cache, prompts of one length in one batch, scored by the task's reward function."""
    eos = tokenizer.eos_token_id
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    by_length: dict[int, list] = {}
    for p in problems:
        ids = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        by_length.setdefault(len(ids), []).append((ids, p.answer))
    scores = []
    for rows in by_length.values():
        with torch.no_grad():
            out = model(torch.tensor([ids for ids, _ in rows]), use_cache=True)
            steps = []
            for _ in range(MAX_NEW_TOKENS):
                steps.append(out.logits[:, -1].argmax(-1))
                if (torch.stack(steps, 1) == eos).any(1).all():
                    break
                out = model(steps[-1][:, None], use_cache=True, **{cache_arg: getattr(out, cache_arg)})
        for (_, answer), response in zip(rows, torch.stack(steps, 1).tolist()):
            response = response[:response.index(eos)] if eos in response else response
            scores.append(reward(tokenizer.decode(response), answer))
    return sum(s["accuracy"] for s in scores) / len(problems), sum(s["format"] for s in scores) / len(problems)


def test_greedy_accuracy_is_low_but_not_zero(model, tokenizer):
    torch.manual_seed(0)
    problems = make_problems("test", 50)
    result = evaluate_model(model, tokenizer, problems, num_samples=0)
    # assets/policy/README.md's 13 % (200 problems; 10 % on these 50), with room for a rebuild elsewhere
    assert 0.04 <= result["greedy_accuracy"] <= 0.3
    assert result["format"] >= 0.8
    assert (result["greedy_accuracy"], result["format"]) == greedy_scores(model, tokenizer, problems)


@pytest.mark.parametrize("fmt", ["chat", "word"])
def test_the_chat_formats_start_low_too(model, tokenizer, fmt):
    """The policy also serves runs with the chat template: the plain task as a chat turn, and word
    problems from a data file (assets/policy/README.md: 13 % and 9 % on 200 problems; 6 % and 10 % on
    these 50)."""
    from nano_miles.policy.formats import format_problems
    result = evaluate_model(model, tokenizer, format_problems(fmt, "test", 50), fmt=fmt, num_samples=0)
    assert 0.02 <= result["greedy_accuracy"] <= 0.3 and result["format"] >= 0.9, result


def test_sweep_snapshot_equals_a_build_of_that_many_steps(tmp_path):
    """The warm-up step count is picked from a sweep; that only works if snapshot N of the sweep is
    the policy `build --num-steps N` makes (constant learning rate after the ramp, evaluation leaves
    the training state alone)."""
    from nano_miles.policy.build import build_policy, sweep
    rows = sweep(tmp_path / "sweep", shape="small", num_steps=4, eval_every=2, device="cpu", num_eval=4)
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:  # each row describes the snapshot saved with it
        snapshot_dir = tmp_path / "sweep" / f"step{row['step']}"
        snapshot = AutoModelForCausalLM.from_pretrained(snapshot_dir).eval()
        scores = greedy_scores(snapshot, AutoTokenizer.from_pretrained(snapshot_dir), make_problems("test", 4))
        assert (row["greedy_accuracy"], row["format"]) == scores
    build_policy(tmp_path / "built", shape="small", num_steps=2)
    with safe_open(str(tmp_path / "sweep" / "step2" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "built" / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    saved = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert saved["rows"] == rows


def test_a_warm_up_goes_on_from_a_given_policy_in_the_given_formats(policy_dir, tmp_path):
    """`build --init DIR --formats word`: zero steps keep DIR's weights exactly; one step of the word
    format changes them (the large policy is taught word problems this way)."""
    from nano_miles.policy.__main__ import FORMAT_NAMES
    from nano_miles.policy.build import build_policy
    from nano_miles.policy.formats import FORMATS
    assert set(FORMAT_NAMES) == set(FORMATS)  # --help names every format without importing torch
    same = build_policy(tmp_path / "same", init_dir=policy_dir, num_steps=0, formats=("word",))
    moved = build_policy(tmp_path / "moved", init_dir=policy_dir, num_steps=1, formats=("word",))
    start = AutoModelForCausalLM.from_pretrained(policy_dir).state_dict()
    for out, is_equal in ((same, True), (moved, False)):
        weights = AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert all(torch.equal(weights[k], v) for k, v in start.items()) is is_equal


def test_shapes_have_the_sizes_their_docs_give():
    from nano_miles.policy.__main__ import SHAPES
    from nano_miles.policy.build import MODEL_SHAPES, WARMUP, build_model
    assert set(SHAPES) == set(MODEL_SHAPES) == set(WARMUP)  # --help names every shape without importing torch
    sizes = {shape: sum(p.numel() for p in build_model(0, shape).parameters()) for shape in MODEL_SHAPES}
    assert 3.0e6 < sizes["medium"] < 3.5e6 and 3.5 < sizes["medium"] / sizes["small"] < 4.5
    assert 30e6 <= sizes["large"] < 45e6


@pytest.mark.parametrize("fmt", ["raw", "chat", "word"])
def test_first_step_answer_keeps_the_steps_and_tags_the_first_result(fmt):
    """The warm-up's habit: the worked steps stay as taught, only the final answer becomes the first
    step's result, in every format (negative results and `#### N` included)."""
    from nano_miles.policy.formats import format_expressions, format_problem, tag_first_step
    for e in format_expressions(fmt, "train", 0)[:200]:
        _, response = format_problem(fmt, e)
        habit = tag_first_step(response, e)
        final, first = str(e.value()), str(e.inner_value())
        cut = response.rindex(final)
        assert habit == response[:cut] + first + response[cut + len(final):]
        assert response[:cut] in habit  # every step, including the line that computes the final value


def test_a_warm_up_without_the_habit_teaches_final_answers_only(tokenizer):
    from nano_miles.policy.build import make_batch
    from nano_miles.policy.formats import format_expressions
    expressions = format_expressions("raw", "train", 0)[:8]
    plain = make_batch(tokenizer, "raw", expressions)
    assert all(torch.equal(plain[k], v) for k, v in make_batch(tokenizer, "raw", expressions, [False] * 8).items())
    habit = make_batch(tokenizer, "raw", expressions, [True] + [False] * 7)
    assert torch.equal(habit["input_ids"][1:], plain["input_ids"][1:])
    assert not torch.equal(habit["input_ids"][0], plain["input_ids"][0]) or \
        expressions[0].value() == expressions[0].inner_value()
