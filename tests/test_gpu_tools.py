"""The calculator tool's rollout on SGLang on a GPU: conversations through SGLang's own response format,
token in, token out across turns (the trainer's bf16 log-probs of the model's tokens against SGLang's),
and the taught policy with and without its tool through the pipeline's evaluation.

Run on a GPU host with sglang installed: python -m pytest -m gpu tests/test_gpu_tools.py -s
Skipped where there is no CUDA device or no sglang (CI). With $NANOMILES_GPU_REPORT set, the measured
figures are also written there as JSON.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import GPU_ONLY, report
from test_tools import POLICY, tools_config
from nano_miles.algo.grpo import assemble_batch, token_scores
from nano_miles.engine.client import EngineClient, sampling_seed
from nano_miles.rewards import load_reward
from nano_miles.rewards.worker import RewardWorker
from nano_miles.rollouts import Record, RolloutEngine, sample_group
from nano_miles.rollouts.calculator import calculate
from nano_miles.rollouts.tools import parse_call, rollout
from nano_miles.stages.trainer.evaluate import make_evaluator
from nano_miles.tasks import load_problems
from nano_miles.tasks.prompts import encode_prompts, load_tokenizer, stop_token_ids

pytestmark = GPU_ONLY

MAX_PARITY_BF16 = 0.01  # mean |log p_engine - log p_trainer| over the model's tokens, both in bf16 (as test_gpu.py)


@pytest.fixture(scope="module")
def sglang_url(tmp_path_factory):
    from harness.servers import start_sglang, stop_sglang

    proc, url = start_sglang(POLICY, tmp_path_factory.mktemp("sglang") / "engine.log")
    yield url
    stop_sglang(proc)


def test_tool_conversations_on_sglang_train_the_ids_sglang_saw(sglang_url):
    cfg = tools_config()
    tokenizer = load_tokenizer(POLICY)
    problems = load_problems(cfg, "test")[:16]
    prompts = encode_prompts(tokenizer, problems, cfg.task)
    client = EngineClient(sglang_url)
    model = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.bfloat16).cuda().eval()
    gaps, num_tool_turns = [], 0
    for i, (problem, prompt) in enumerate(zip(problems, prompts)):
        engine = RolloutEngine(client.generate, group_size=4, max_new_tokens=cfg.rollout.max_new_tokens,
                               sampling={"temperature": 1.0}, max_turns=cfg.rollout.max_turns, tokenizer=tokenizer,
                               stop_token_ids=stop_token_ids(POLICY, tokenizer, chat_template=True),
                               seed_of=lambda j, n, i=i: sampling_seed(0, i, j, n))
        for s in sample_group(rollout, Record(i, problem.prompt, prompt, problem.answer), engine):
            for (a, b, is_model), (c, d, _) in zip(s.turns, s.turns[1:]):
                if is_model:
                    call = parse_call(tokenizer.decode(s.response_tokens[a:b], skip_special_tokens=True))
                    tool_turn = tokenizer.decode(s.response_tokens[c:d], skip_special_tokens=True)
                    assert tool_turn.split("\n")[2] == calculate(call[1]), tool_turn
                    num_tool_turns += 1
            batch = assemble_batch([prompt], [s.response_tokens], [s.logprobs], [0.0], tokenizer.pad_token_id,
                                   [s.model_mask]).to("cuda")
            with torch.no_grad():
                mine = token_scores(model, batch.input_ids, batch.targets, batch.attention_mask, 1.0,
                                    positions=batch.loss_mask)[0][batch.loss_mask].float().cpu()
            gaps += (mine - torch.from_numpy(s.logprobs[s.model_mask].copy())).abs().tolist()
    parity = sum(gaps) / len(gaps)
    report("tools_sglang_parity_bf16", parity)
    report("tools_sglang_tool_turns_of_64", num_tool_turns)
    assert num_tool_turns >= 16 and parity < MAX_PARITY_BF16, (num_tool_turns, parity)


def test_the_taught_policy_with_and_without_its_tool_on_sglang(sglang_url):
    accuracy = {}
    for name, extra in (("tool", []), ("no_tool", ["--rollout.fn=nano_miles.rollouts.single_turn:rollout",
                                                    "--task.system_prompt=", "--rollout.max_new_tokens=48"])):
        cfg = tools_config("--task.num_test=0", *extra)
        tokenizer = load_tokenizer(POLICY)
        worker = RewardWorker(load_reward(cfg.reward), cfg.reward.timeout_s, cfg.reward.num_workers)
        worker.start()
        try:
            evaluate = make_evaluator(cfg, load_problems(cfg, "test"), tokenizer, worker,
                                      stop_token_ids(POLICY, tokenizer, chat_template=True))
            accuracy[name] = evaluate(EngineClient(sglang_url), 0, 0.0).accuracy
        finally:
            worker.stop()
    report("tools_sglang_heldout_with_tool", accuracy["tool"])
    report("tools_sglang_heldout_without_tool", accuracy["no_tool"])
    assert accuracy["tool"] >= accuracy["no_tool"] + 0.25, accuracy
