"""Copies of a group that reach the trainer late, twice, or from weights it no longer has.

Run: `pytest tests/test_redelivery.py`. Real stages in one process, each driven step by step: a rollout
producer on a real local engine (its loop's work done by `pump`, its control socket answered on a
thread), a reward stage scoring with the real reward function, and trainers taking real steps on the
shipped policy; every hop is a real ZeroMQ socket on an ipc:// path under tmp_path.
"""

import contextlib
import threading
import time

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM

from conftest import start_engine, stop_process
from nano_miles.rewards import load_reward
from nano_miles.run.config import load_config
from nano_miles.stages.reward.scorer import RewardStage
from nano_miles.stages.rollout.producer import RolloutProducer
from nano_miles.stages.trainer.checkpoint import save_checkpoint
from nano_miles.stages.trainer.step_loop import Trainer
from nano_miles.tasks import load_problems, split_identity
from nano_miles.tasks.prompts import encode_prompts, load_tokenizer, make_decoder


@pytest.fixture(scope="module")
def engine_port(policy_dir, tmp_path_factory):
    """A local engine of this module's own: the trainers here push their weights into it."""
    proc, url = start_engine(policy_dir, tmp_path_factory.mktemp("engine") / "engine.log")
    yield url.rsplit(":", 1)[1]
    stop_process(proc)


class Stages:
    """A producer, a reward stage and trainers of one run, wired as supervisord wires the processes."""

    def __init__(self, tmp_path, engine_port: str, overrides: list[str]):
        self.cfg = load_config(overrides=[
            f"--run.dir={tmp_path}/run", f"--engine.port={engine_port}",
            f"--rollout.control_endpoint=ipc://{tmp_path}/control", f"--reward.endpoint=ipc://{tmp_path}/reward",
            f"--trainer.endpoint=ipc://{tmp_path}/trainer", "--rollout.metrics_port=0", "--reward.metrics_port=0",
            "--trainer.metrics_port=0", "--metrics.queue_sample_s=0", "--trainer.batch_groups=1",
            "--rollout.group_size=2", "--rollout.max_new_tokens=8", "--task.num_train=50", *overrides])
        (tmp_path / "run").mkdir()
        self.ctx = zmq.Context()
        self.tokenizer = load_tokenizer(self.cfg.model_dir)
        problems = load_problems(self.cfg, "train")
        self.reward = RewardStage(self.cfg, self.ctx, load_reward(self.cfg.reward), make_decoder(self.tokenizer))
        self.producer = RolloutProducer(self.cfg, self.ctx, problems,
                                        encode_prompts(self.tokenizer, problems, self.cfg.task), stop_token_ids=[])
        self.trainers: list[Trainer] = []
        self.is_stopping = threading.Event()
        # The producer's REP socket, answered on its own thread as its loop would: the test's thread
        # is blocked in the trainer's request meanwhile, so the two never touch the producer at once.
        self.control = threading.Thread(target=self.answer_control, daemon=True)
        self.control.start()

    def answer_control(self) -> None:
        while not self.is_stopping.is_set():
            self.producer.control.poll_once(0.05)

    def trainer(self) -> Trainer:
        """A trainer process (re)started on the run directory: it resumes from the newest checkpoint."""
        for old in self.trainers:  # the previous one died: its sockets go with it
            old.pull.close(linger=0)
            old.peers.control.close()
        model = AutoModelForCausalLM.from_pretrained(str(self.cfg.model_dir), dtype=torch.float32)
        trainer = Trainer(self.cfg, self.ctx, model, self.tokenizer, evaluator=None,
                          split=split_identity(self.cfg, load_problems(self.cfg, "train")))
        self.trainers.append(trainer)
        trainer.connect()
        return trainer

    def pump(self, until, what: str, timeout_s: float = 60.0) -> None:
        """The producer loop's work (collect, hand on, issue under the gate) until `until()`; leases
        are expired only where a test says so."""
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, f"never {what}: {self.producer.on_status()}"
            self.producer.collect()
            self.producer.flush_outbox()
            while self.producer.may_issue():
                self.producer.issue()
            time.sleep(0.01)

    def send(self, num_groups: int) -> None:
        """The producer sends groups until `num_groups` went to the reward stage in all."""
        self.pump(lambda: self.producer.state.num_sent >= num_groups, f"sent {num_groups} groups")

    def score(self, num_groups: int) -> None:
        """The reward stage scores `num_groups` groups from its queue, in order, and pushes them on."""
        for _ in range(num_groups):
            assert self.reward.pull.poll(30_000), "no group reached the reward stage"
            self.reward.handle(self.reward.pull.recv())

    def close(self) -> None:
        self.is_stopping.set()
        self.control.join(timeout=10)
        self.producer.close()
        self.reward.close()
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def stages(tmp_path, engine_port, *overrides):
    s = Stages(tmp_path, engine_port, list(overrides))
    try:
        yield s
    finally:
        s.close()


def take_step(trainer: Trainer) -> list[str]:
    """One step of `Trainer.train` (pull, optimize, commit, push the new weights), no evaluation."""
    groups, _ = trainer.pull_batch()
    trainer.state.step += 1  # the model holds the step from its optimizer pass on
    trainer.optimize(groups)
    trainer.commit(trainer.step, trainer.state.trained_by_step[trainer.step])
    trainer.peers.update_weights(trainer.model, trainer.step)
    trainer.state.version = trainer.step
    return [sg.group.group_id for sg in groups]


def drops_counted(trainer: Trainer, reason: str) -> float:
    return trainer.metrics.registry.get_sample_value("nanomiles_dropped_groups_total", {"reason": reason}) or 0.0


def test_a_copy_whose_lease_ran_out_in_reward_is_trained_once(tmp_path, engine_port):
    with stages(tmp_path, engine_port, "--rollout.lease_s=0.5") as s:
        trainer = s.trainer()
        s.send(1)  # e0-i0 waits in the reward stage, which does not take it in time
        time.sleep(0.6)
        assert s.producer.ledger.expire(busy=set(s.producer.state.inflight)) == ["e0-i0"]
        s.send(2)  # ...so the producer issues it again
        assert s.producer.ledger.attempts["e0-i0"] == 1
        s.score(2)  # the late copy and the new one both reach the trainer
        assert take_step(trainer) == ["e0-i0"]
        s.send(3)
        s.score(1)
        assert take_step(trainer) == ["e0-i1"]  # the second copy of e0-i0 was refused
        assert trainer.drops == {"duplicate": 1} and drops_counted(trainer, "duplicate") == 1
        assert trainer.state.trained_by_step == {1: ["e0-i0"], 2: ["e0-i1"]}
        status = s.producer.on_status()
        assert status["num_reissued"] == 1 and status["outstanding_group_ids"] == []  # not issued again


def test_groups_from_rolled_back_weights_are_refused_and_issued_again_once(tmp_path, engine_port):
    # async, max_staleness 1: after the restart the producer re-issues the lost groups at once, so a
    # new copy of each is on its way when the restarted trainer refuses the old one. The samples of a
    # group are generated together with those of others, so which group arrives first is left open.
    with stages(tmp_path, engine_port, "--run.mode=async", "--run.max_staleness=1") as s:
        first = s.trainer()
        s.send(2)  # the gate lets e0-i0 and e0-i1 start on version 0
        s.score(2)
        kept = take_step(first)
        save_checkpoint(first.run_dir / "checkpoints", first.model, first.tokenizer, first.learner, first.state)
        lost = take_step(first)  # after the checkpoint: lost with the restart below
        s.send(4)  # e0-i2 and e0-i3 on version 2; they wait in the reward stage
        second = s.trainer()  # the trainer died and restarted from its checkpoint of step 1
        assert (second.step, second.state.version, second.trained_ids) == (1, 1, set(kept))
        assert second.peers.engine.model_info()["weight_version"] == "1"
        s.send(6)  # the producer issued e0-i2 and e0-i3 again at once, on version 1
        assert s.producer.ledger.attempts == {**dict.fromkeys(kept + lost, 0), "e0-i2": 1, "e0-i3": 1}
        s.score(4)  # both copies of each reach the restarted trainer, the old ones first
        second_step = take_step(second)  # a new copy, after refusing both old ones
        assert second_step in (["e0-i2"], ["e0-i3"])
        assert second.drops == {"future_version": 2} and drops_counted(second, "future_version") == 2
        s.send(7)  # room for one more group on version 2: the one the restart lost
        # a refused copy's report must not send back in line the copy of it still on its way
        assert s.producer.ledger.attempts == {**dict.fromkeys(kept, 0), **dict.fromkeys(lost, 1),
                                              "e0-i2": 1, "e0-i3": 1}
        s.score(1)  # the lost group; the other new copy waits in the trainer's queue already
        later = take_step(second) + take_step(second)
        assert sorted(second_step + later) == sorted(lost + ["e0-i2", "e0-i3"])
        assert second.drops == {"future_version": 2}  # and no duplicate: every group was made once more
