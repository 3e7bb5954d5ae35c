"""The rollout seam: the engine adapter, trajectories across turns (token in, token out), the calculator tool."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from test_async import freeze_mid_sample
from nano_miles.algo.admission import STALE, refusal, staleness
from nano_miles.algo.grpo import assemble_batch, token_scores
from nano_miles.engine.client import EngineClient, sampling_seed
from nano_miles.rollouts import Record, RolloutEngine, Trajectory, sample_group
from nano_miles.rollouts.calculator import Calculator, calculate
from nano_miles.rollouts.tools import answer, parse_call
from nano_miles.run.child import TIMEOUT, CallFailed, ChildFunction
from nano_miles.run.cli import UserError
from nano_miles.tasks.prompts import load_tokenizer, prompt_ids, turn_ids
from nano_miles.weights.tensor_sender import push_weights
from nano_miles.wire.data import NO_VERSION, RolloutGroup, decode_rollout, encode_rollout

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_rollout():
    """The two-turn rollout function the README shows under "Write your own rollout", run as printed."""
    text = README.read_text()
    section = text[text.index("## Write your own rollout"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("\n```", start)]
    assert len(code.splitlines()) < 40, "the README's example is to stay short"
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace["rollout"], namespace["FOLLOW_UP"]


def adapter(send, *, group_size=4, max_new_tokens=48, tokenizer=None, temperature=1.0):
    return RolloutEngine(send, group_size=group_size, max_new_tokens=max_new_tokens,
                         sampling={"temperature": temperature}, stop_token_ids=[1, 262], tokenizer=tokenizer,
                         seed_of=lambda i, n: sampling_seed(0, "e0-i0", 0, i, n))


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression,value", [
    ("(7*4)+12", "40"), ("12 - 3 * 2", "6"), ("-(2-5)*3", "9"), ("1/3", "0.333333"), ("1.5*4", "6"),
    ("7/2", "3.5"), ("2*(3", "error: unclosed parenthesis"), ("1/0", "error: division by zero"),
    ("7 % 2", "error: unexpected '%'"), ("", "error: expected a number"), ("3 4", "error: unexpected '4'"),
    ("__import__('os').system('true')", "error: unexpected '_'"), ("9" * 31, "error: a number of more than 30 digits"),
    ("(" * 40 + "1" + ")" * 40, "error: nested deeper than 32"), ("1+" * 150 + "1", "error: longer than 200 characters"),
])
def test_calculator_values_and_errors(expression, value):
    assert calculate(expression) == value


def test_calculator_runs_in_its_own_process_and_survives_its_death():
    calc = Calculator()
    try:
        assert calc("6*7") == "42"
        calc.child.proc.kill()  # the sandbox dies under the next call: that call fails, the next works
        calc.child.proc.join()
        assert calc("1+1") == "error: died"
        assert calc("2+2") == "4" and calc.child.num_restarts == 1
    finally:
        calc.stop()


def test_a_hanging_child_costs_one_call_and_is_replaced():
    child = ChildFunction(time.sleep, 0.3, start_method="spawn", name="sleeper")
    try:
        with pytest.raises(CallFailed) as failed:
            child(5)
        assert failed.value.reason == TIMEOUT and child.num_restarts == 1
        assert child(0) is None
    finally:
        child.stop()


@pytest.mark.parametrize("text,call", [
    ("so <tool_call>(7*4)+12</tool_call>", ("calculator", "(7*4)+12")),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>', ("calculator", "2+2")),
    ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}</tool_call>',
     ("calculator", "3*3")),
    ("<tool_call>1+1</tool_call> then <tool_call>2+2</tool_call>", ("calculator", "2+2")),  # the last call
    ("#### 40", None), ("<tool_call>1+1", None),
])
def test_tool_calls_are_parsed_in_both_conventions(text, call):
    assert parse_call(text) == call


def test_an_unknown_tool_is_answered_with_an_error():
    assert answer(("web_search", "x")) == "error: unknown tool 'web_search' (the one tool is 'calculator')"


# ---------------------------------------------------------------- trajectories and the adapter


def test_turn_ids_extend_the_chat_token_by_token(policy_dir):
    """The next turn's ids, appended to a chat's ids, give the ids of the whole chat rendered at once:
    nothing before them would be tokenized differently."""
    tok = load_tokenizer(policy_dir)
    chat = [{"role": "user", "content": "What is 2+3?"}]
    prompt = prompt_ids(tok, "What is 2+3?", chat_template=True)
    model_turn = tok("<tool_call>2+3</tool_call>", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    extended = prompt + model_turn + turn_ids(tok, {"role": "tool", "content": "5"})
    whole = tok.apply_chat_template([*chat, {"role": "assistant", "content": "<tool_call>2+3</tool_call>"},
                                     {"role": "tool", "content": "5"}], tokenize=False, add_generation_prompt=True)
    assert extended == tok(whole, add_special_tokens=False)["input_ids"]


def test_the_readmes_two_turns_train_exactly_the_ids_the_engine_saw(engine_url, policy_dir):
    """The README's example runs, and keeps token in, token out across turns: the trajectory's ids are
    those the engine read and wrote, turn by turn; the engine scores each turn the same given the ids
    before it; and the trainer's log-probs of the assembled sample, at its model tokens only, equal the
    engine's."""
    two_turn, follow_up_text = readme_rollout()
    tok = load_tokenizer(policy_dir)
    client = EngineClient(engine_url)
    prompt = prompt_ids(tok, "What is (3 * 4) + 5? Put the answer in <answer></answer>.\n", chat_template=True)
    engine = adapter(client.generate, tokenizer=tok, max_new_tokens=120)
    samples = sample_group(two_turn, Record(0, "p", prompt, "17"), engine)
    follow_up = turn_ids(tok, {"role": "user", "content": follow_up_text})
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype="float32").eval()
    assert all(len(s.turns) == 3 for s in samples), [s.finish_reason for s in samples]
    for s in samples:
        (a0, a1, m0), (b0, b1, m1), (c0, c1, m2) = s.turns
        assert (m0, m1, m2) == (True, False, True)
        assert s.response_tokens[b0:b1].tolist() == follow_up  # the follow-up's ids, as tokenized once
        assert (s.versions[b0:b1] == NO_VERSION).all() and (s.logprobs[b0:b1] == 0).all()
        for start, end in ((a0, a1), (c0, c1)):  # each model turn: the engine's scores given what it read
            before = prompt + s.response_tokens[:start].tolist()
            scored = client.score(before, s.response_tokens[start:end].tolist())
            assert np.allclose(scored, s.logprobs[start:end], atol=1e-4)
        batch = assemble_batch([prompt], [s.response_tokens], [s.logprobs], [1.0], tok.pad_token_id, [s.model_mask])
        with torch.no_grad():
            mine = token_scores(model, batch.input_ids, batch.targets, batch.attention_mask, 1.0,
                                positions=batch.loss_mask)[0]
        assert batch.num_tokens == s.num_model_tokens == (a1 - a0) + (c1 - c0)
        gap = (mine[batch.loss_mask] - torch.from_numpy(s.logprobs[s.model_mask].copy())).abs().max().item()
        assert gap < 1e-4, gap
    group = RolloutGroup("e0-i0", 0, np.asarray(prompt, np.int32), samples, run_id="r")
    assert decode_rollout(encode_rollout(group)) == group  # trajectories travel whole


def test_the_rollout_function_is_held_to_its_contract(engine_url):
    engine = adapter(EngineClient(engine_url).generate, group_size=2)
    record = Record(0, "p", [5, 6, 7], "0")
    with pytest.raises(UserError, match="must return a list of 2 trajectories .* it returned 1 items"):
        sample_group(lambda r, e: [Trajectory.of(e.generate([r.prompt_ids])[0])], record, engine)
    with pytest.raises(UserError, match="returned str at 0: each item must be a Trajectory"):
        sample_group(lambda r, e: ["a", "b"], record, engine)
    with pytest.raises(UserError, match="holding at least one of the model's turns"):
        sample_group(lambda r, e: [Trajectory().add_environment([5]), Trajectory.of(e.generate([[5]])[0])],
                     record, engine)
    with pytest.raises(ValueError, match="budgets must be >= 1"):
        engine.generate([[5]], max_new_tokens=0)


def test_a_conversation_is_resumed_across_a_weight_update_mid_turn(long_talker, tmp_path):
    """A weight update (abort-mode pause) in the middle of the second turn: the rollout function never
    sees it, the turn is resumed under the new weights, every model token keeps the version and the
    log-prob of the weights that wrote it, and the group's staleness counts from its oldest token."""
    model, url = long_talker
    client, prompt, environment = EngineClient(url), [5, 6, 7, 8, 9], [1, 2, 3]
    first_turn_done = threading.Event()

    def talk(record, engine):
        trajectories = [Trajectory.of(g) for g in engine.generate([record.prompt_ids] * 4, max_new_tokens=16)]
        for t in trajectories:
            t.add_environment(environment)
        first_turn_done.set()
        second = engine.generate([record.prompt_ids + t.tokens for t in trajectories], max_new_tokens=300)
        return [t.add_generation(g) for t, g in zip(trajectories, second)]

    resumed = []
    engine = RolloutEngine(client.generate, group_size=4, max_new_tokens=400, sampling={"temperature": 0.8},
                           stop_token_ids=[], seed_of=lambda i, n: sampling_seed(1, i, n), on_resumed=resumed.append)
    result = {}
    worker = threading.Thread(target=lambda: result.update(samples=sample_group(talk, Record(0, "p", prompt, "0"), engine)))
    worker.start()
    assert first_turn_done.wait(120)
    freeze_mid_sample(client)
    old_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    client.pause("abort")
    push_weights(client, model, 1)
    client.resume()
    worker.join(timeout=120)
    assert "samples" in result and resumed == [4]
    new_state = {k: v.clone() for k, v in model.state_dict().items()}
    for s in result["samples"]:
        assert s.response_tokens[16:19].tolist() == environment and s.loss_mask.tolist() == [1] * 16 + [0] * 3 + [1] * 300
        assert set(s.versions[:16].tolist()) == {0} and s.versions[-1] == 1  # first and last model tokens differ
        assert (s.oldest_version, s.newest_version) == (0, 1)
        ids = torch.tensor([prompt + s.response_tokens.tolist()])
        for version, state in ((0, old_state), (1, new_state)):
            model.load_state_dict(state)
            with torch.no_grad():
                logits = model(ids[:, :-1]).logits[0, len(prompt) - 1:].float() / 0.8
            expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            mine = torch.from_numpy(s.versions == version)
            assert (expected[mine] - torch.from_numpy(s.logprobs.copy())[mine]).abs().max().item() < 1e-4
    group = RolloutGroup("e0-i0", 0, np.asarray(prompt, np.int32), result["samples"], run_id="r")
    # step 2 trains on version 1: the group is 1 version stale through its first-turn tokens, not 0
    assert group.oldest_version == 0 and staleness(2, group.oldest_version) == 1
    assert refusal(2, oldest_version=group.oldest_version, newest_version=group.newest_version, is_consumed=False,
                   max_staleness=0, has_signal=True, skip_zero_variance=False) == STALE
