"""The trainer's step on the shipped policy: truncated importance sampling, resuming from a checkpoint,
what a restart refuses (another train split) and keeps (goodput's parts), and a stop while pulling.

Run: `pytest tests/test_trainer.py`. A real `Trainer` (its PULL socket bound on an ipc:// path under
tmp_path) takes steps on scored groups built here; no peer is needed, since `optimize` and the
checkpoint calls are the step loop without the commit and the weight push.
"""

import copy
import math
import threading

import numpy as np
import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM, AutoTokenizer

from nano_miles.run.cli import UserError
from nano_miles.run.config import load_config
from nano_miles.run.process import StopRequested
from nano_miles.stages.trainer.checkpoint import save_checkpoint
from nano_miles.stages.trainer.step_loop import Trainer
from nano_miles.tasks import load_problems, split_identity
from nano_miles.tasks.prompts import encode_prompts
from nano_miles.tasks.arithmetic import make_expressions, make_problems
from nano_miles.wire.codec import make_group_id
from nano_miles.wire.control import ProducerStatus
from nano_miles.wire.data import RolloutGroup, Sample, ScoredGroup, encode_scored
from nano_miles.wire.sockets import make_socket

TEMPERATURE = 0.8
TIS_CLIP = 1.5
ADVANTAGE = 0.5 / (0.5 + 1e-6)  # rewards [1, 0], whitened with the population std


@pytest.fixture
def make_trainer(policy_dir, tmp_path, monkeypatch):
    """Trainers on one run directory, each with a fresh copy of the shipped policy and its own socket."""
    monkeypatch.delenv("NANOMILES_OVERRIDES", raising=False)
    monkeypatch.delenv("NANOMILES_CONFIG", raising=False)
    (tmp_path / "run").mkdir()
    ctx, trainers = zmq.Context(), []
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)

    def make(*overrides: str) -> Trainer:
        cfg = load_config(overrides=[
            f"--run.dir={tmp_path}/run", f"--trainer.endpoint=ipc://{tmp_path}/t{len(trainers)}",
            "--trainer.metrics_port=0", "--metrics.queue_sample_s=0", f"--rollout.temperature={TEMPERATURE}",
            "--trainer.lr=1e-3", *overrides])
        model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
        trainers.append(Trainer(cfg, ctx, model, tokenizer, evaluator=None,
                                split=split_identity(cfg, load_problems(cfg, "train"))))
        return trainers[-1]
    make.ctx = ctx
    yield make
    for t in trainers:
        t.pull.close(linger=0)
    ctx.destroy(linger=0)


def response_logprobs(model, prompt: list[int], response: list[int]) -> np.ndarray:
    """log softmax(logits / T) of each response token, from one plain forward of the sample alone."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
    logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
    return logp.numpy()


def scored_groups(policy_dir, first_index: int, log_w: list[float]) -> list[ScoredGroup]:
    """Two groups of two samples (a worked answer and a cut-short one, rewards [1, 0]) whose behaviour
    logprobs are the base policy's minus `log_w` (cycled over the tokens): log pi_old - log pi_engine."""
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    problems = make_problems("train", first_index + 2)[first_index:]
    expressions = make_expressions("train", first_index + 2)[first_index:]
    groups, k = [], 0
    for i, (expression, prompt) in enumerate(zip(expressions, encode_prompts(tokenizer, problems, load_config().task))):
        text = expression.worked_response()
        samples = []
        for response_text in (text, text[:4 + 3 * i]):
            response = tokenizer(response_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            offsets = [log_w[(k + j) % len(log_w)] for j in range(len(response))]
            k += len(response)
            behaviour = response_logprobs(model, prompt, response) - np.array(offsets)
            samples.append(Sample(np.array(response, np.int32), behaviour.astype(np.float32),
                                  np.zeros(len(response), np.int32), "stop"))
        group = RolloutGroup(make_group_id(0, first_index + i), 0, np.array(prompt, np.int32), samples,
                             run_id="run-test")
        groups.append(ScoredGroup(group, np.array([1.0, 0.0], np.float32)))
    return groups


def take_step(trainer: Trainer, groups: list[ScoredGroup]):
    """One step of `Trainer.train` without its peers: step counter, optimize, new weight version."""
    trainer.state.step += 1
    stats, _ = trainer.optimize(groups)
    trainer.state.version = trainer.step
    return stats


def test_recomputed_old_logprobs_take_the_ratio_and_truncated_is_weights_correct_to_the_engine(
        make_trainer, policy_dir):
    log_w = [0.8, -0.3, 0.0, 0.2, -1.0, 0.6]  # 0.8 and 0.6 exceed log(TIS_CLIP) = 0.405: truncated
    groups = scored_groups(policy_dir, 0, log_w)
    trainer = make_trainer("--trainer.recompute_old_logprobs=true", f"--trainer.tis_clip={TIS_CLIP}")
    # expected, token by token in plain floats: pi_old is the trainer's model before the step (the
    # base policy, so the PPO ratio is exactly 1), pi_engine the behaviour logprobs on the wire
    base = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
    weights, weighted_adv, gaps = [], 0.0, []
    for sg in groups:
        prompt = sg.group.prompt_tokens.tolist()
        for sample, adv in zip(sg.group.samples, (ADVANTAGE, -ADVANTAGE)):
            old = response_logprobs(base, prompt, sample.response_tokens.tolist())
            for o, e in zip(old, sample.logprobs.astype(np.float64)):
                w = min(math.exp(o - e), TIS_CLIP)
                weights.append(w)
                weighted_adv += w * float(adv)
                gaps.append(abs(o - e))
    assert sum(w >= TIS_CLIP for w in weights) >= 4 and sum(w < 1 for w in weights) >= 4

    stats = take_step(trainer, groups).as_dict()
    assert stats["num_tokens"] == len(weights)
    assert stats["is_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-5)
    assert stats["is_weight_max"] == pytest.approx(TIS_CLIP, rel=1e-6)
    assert stats["is_weight_clipped"] == pytest.approx(sum(w >= TIS_CLIP for w in weights) / len(weights))
    # ratio = pi_theta / pi_old(recomputed) = 1: nothing is clipped, the loss is -mean(w * A);
    # against the engine's logprobs the ratio would be e^0.8 on some tokens and clipped there
    assert stats["clip_fraction"] == 0.0
    assert stats["pg_loss"] == pytest.approx(-weighted_adv / len(weights), rel=1e-5)
    assert stats["parity"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-5)  # still measured to the engine


def optimizer_state(trainer: Trainer) -> dict:
    return copy.deepcopy(trainer.learner.optimizer.state_dict())


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for k, state in a["state"].items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"} == set(b["state"][k])
        for name, value in state.items():
            assert torch.equal(value, b["state"][k][name]), (k, name)


SCHEDULE = ["--trainer.lr_warmup_steps=2", "--trainer.lr_schedule=cosine", "--trainer.num_steps=5",
            "--trainer.lr_min=1e-4"]


def test_resumed_trainer_takes_the_same_next_step_as_an_uninterrupted_one(make_trainer, policy_dir):
    """Weights, optimizer and the learning-rate schedule all continue where the checkpoint left them."""
    batches = [scored_groups(policy_dir, 2 * n, [0.1, -0.2, 0.0]) for n in range(4)]
    trainer = make_trainer(*SCHEDULE)
    lrs = [take_step(trainer, groups).learned.lr for groups in batches[:2]]
    assert lrs == pytest.approx([5e-4, 1e-3])  # warm-up
    save_checkpoint(trainer.run_dir / "checkpoints", trainer.model, trainer.tokenizer, trainer.learner,
                    trainer.state)
    saved_state, saved_optimizer = copy.deepcopy(trainer.state), optimizer_state(trainer)
    assert (saved_state.step, saved_state.version, saved_state.cursor) == (2, 2, 4)
    assert all(int(s["step"]) == 2 for s in saved_optimizer["state"].values())

    resumed = make_trainer(*SCHEDULE)  # the same run directory: it starts from the checkpoint
    assert resumed.state == saved_state and resumed.trained_ids == {"e0-i0", "e0-i1", "e0-i2", "e0-i3"}
    assert_same_optimizer_state(optimizer_state(resumed), saved_optimizer)
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name

    for groups, want_lr in zip(batches[2:], [1e-3, 1e-4 + 0.9e-3 * 0.5]):  # the cosine's first steps
        assert take_step(trainer, groups).learned.lr == pytest.approx(want_lr)
        assert take_step(resumed, groups).learned.lr == pytest.approx(want_lr)
    assert resumed.learner.scheduler.state_dict() == trainer.learner.scheduler.state_dict()
    assert resumed.state.cursor == trainer.state.cursor == 8 and resumed.state.version == 4
    assert_same_optimizer_state(optimizer_state(resumed), optimizer_state(trainer))
    for (name, p), q, base in zip(trainer.model.named_parameters(), resumed.model.parameters(),
                                  AutoModelForCausalLM.from_pretrained(str(policy_dir)).parameters()):
        assert torch.equal(p, q), name
        assert not torch.equal(p, base), name  # four steps moved every parameter


def with_versions(sample: Sample, first: int, last: int) -> Sample:
    """The sample with its first half of tokens made by version `first` and the rest by `last`."""
    versions = np.full(len(sample.response_tokens), last, np.int32)
    versions[:len(versions) // 2] = first
    return Sample(sample.response_tokens, sample.logprobs, versions, sample.finish_reason)


def test_staleness_counts_from_a_samples_oldest_token_first_or_last(make_trainer, policy_dir):
    """A sample resumed across an update starts older than it ends (1 then 2); one resumed after a
    restart from an older checkpoint ends older than it starts (2 then 1). Either way the trainer
    admits and measures it by its oldest token, through its real socket and step statistics."""
    trainer = make_trainer("--run.mode=async", "--run.max_staleness=1", "--trainer.batch_groups=2")
    groups = scored_groups(policy_dir, 0, [0.0])
    for sg, (first, last) in zip(groups, [(1, 2), (2, 1)]):
        sg.group.run_id = trainer.state.run_id
        sg.group.samples = [with_versions(sg.group.samples[0], first, last), with_versions(sg.group.samples[1], 2, 2)]
    push = trainer.pull.context.socket(zmq.PUSH)
    push.connect(trainer.pull.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        for sg in groups:
            push.send(encode_scored(sg))
        trainer.state.step = 2  # two steps trained: step 3 trains on version 2, both groups one version stale
        batch, _ = trainer.pull_batch()
    finally:
        push.close(linger=0)
    assert [sg.group.oldest_version for sg in batch] == [1, 1] and trainer.drops == {}
    # one observation per admitted group, from the group's oldest token
    assert trainer.metrics.registry.get_sample_value("nanomiles_staleness_versions_sum") == 2
    trainer.state.step += 1  # as take_step: the model holds step 3 from its optimizer pass on
    stats = trainer.optimize(batch)[0].as_dict()
    assert stats["staleness_hist"] == {"0": 2, "1": 2}  # per sample: the two mixed ones are 1 stale
    assert (stats["staleness_max"], stats["version_oldest"]) == (1, 1)


def test_a_checkpoint_of_another_train_split_is_refused_in_one_line(make_trainer, policy_dir):
    """Group ids, the data cursor and the ledger are positions in the train split: under another split
    they name other prompts (before: 840 counted where 960 were trained, earlier ids vanished)."""
    trainer = make_trainer("--task.num_train=840")
    take_step(trainer, scored_groups(policy_dir, 0, [0.0]))
    save_checkpoint(trainer.run_dir / "checkpoints", trainer.model, trainer.tokenizer, trainer.learner,
                    trainer.state)
    with pytest.raises(UserError) as refused:
        make_trainer("--task.num_train=960")
    message = str(refused.value)
    assert message.startswith("task.num_train is 960, ") and "step_000001 was made with 840" in message
    assert "\n" not in message and "--model.path=" in message, message
    with pytest.raises(UserError, match="task.seed is 1, .* was made with 0"):
        make_trainer("--task.num_train=840", "--task.seed=1")
    # a setting that leaves the problems as they were (how prompts are rendered) is no other split
    resumed = make_trainer("--task.num_train=840", "--task.chat_template=true", "--task.system_prompt=Be brief.")
    assert resumed.step == 1 and resumed.trained_ids == trainer.trained_ids


def test_generated_tokens_of_steps_a_restart_redoes_still_count(make_trainer, policy_dir):
    """Goodput = trained / generated response tokens. A checkpoint rolls the trained count back with the
    steps it redoes, but what those steps generated was spent: the count goes on from the newest step
    record, not from the checkpoint (before: 1.0 after the trainer and the producer restarted together)."""
    trainer = make_trainer()
    for step in range(4):
        stats = take_step(trainer, scored_groups(policy_dir, 2 * step, [0.0]))
        trainer.peers.producer = ProducerStatus(
            version=step + 1, is_paused=False, waiting_for="", num_sent=2 * step + 2,
            num_generated_tokens=1000 * (step + 1), num_resumed_samples=0, num_failed=0, num_reissued=0,
            num_inflight=0, outstanding_group_ids=[], dropped_for_good={})
        trainer.record.write_step(trainer.step_record(stats, wait_s=0.0))
        if step == 1:
            trainer.checkpoint()
    assert trainer.state.num_generated_tokens == 4000
    resumed = make_trainer()  # from step 2, which heard 2000; steps 3 and 4 will be trained again
    assert resumed.step == 2 and resumed.state.num_trained_tokens < trainer.state.num_trained_tokens
    assert resumed.durable_state().num_generated_tokens == 4000  # what a restarted producer counts on from


def test_a_stop_while_pulling_drops_the_batch_and_keeps_the_last_trained_step(make_trainer, policy_dir):
    """SIGTERM's flag, read between two received groups: the half-pulled batch is not trained (its groups
    are issued again after the restart), and the checkpoint holds the step before it."""
    async_two = ["--trainer.batch_groups=2", "--run.mode=async", "--run.max_staleness=1"]  # admits version 0
    trainer = make_trainer(*async_two)
    take_step(trainer, scored_groups(policy_dir, 0, [0.0]))
    push = make_socket(make_trainer.ctx, zmq.PUSH, trainer.cfg.trainer.endpoint, bind=False)
    try:
        trainer.state.run_id = "run-test"  # the run of the groups built here
        push.send(encode_scored(scored_groups(policy_dir, 2, [0.0])[0]))  # one of the batch's two
        threading.Timer(0.5, trainer.request_stop).start()
        with pytest.raises(StopRequested):
            trainer.take_step()
    finally:
        push.close(linger=0)
    assert trainer.step == 1 and trainer.state.cursor == 2 and trainer.trained_ids == {"e0-i0", "e0-i1"}
    trainer.checkpoint()
    resumed = make_trainer(*async_two)
    assert resumed.step == 1 and resumed.trained_ids == {"e0-i0", "e0-i1"} and resumed.state.cursor == 2
