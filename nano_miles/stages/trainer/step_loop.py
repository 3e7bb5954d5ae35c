"""The trainer: pulls scored groups, takes GRPO steps, hot-updates the engine's weights, evaluates.

Library module of `procs/trainer.py`, the trainer process supervisord starts. The modules it names, in the
order a batch meets them: `nano_miles/wire/data.py` (decode), `learner.py` (the optimizer step: micro-batches,
`nano_miles/algo/grpo.py` to assemble and take log-probs, `nano_miles/algo/loss.py` for the loss), `peers.py`
(commit, weight update through `nano_miles/weights/`), `checkpoint.py`, `evaluate.py`,
`nano_miles/observe/run_record.py`.

The step loop (`Trainer.take_step`) is the algorithm: pull -> assemble -> loss -> step -> commit ->
update weights -> evaluate/checkpoint. The trainer owns the only durable state (policy, optimizer,
version, data cursor, which groups each step trained); after a crash it resumes from its newest
checkpoint, and every group trained after that checkpoint is issued again by the producer.
A SIGTERM (`request_stop`) drops a batch still being pulled, records a step already trained without
what needs a peer (`publish`), checkpoints the last step trained and raises StopRequested.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from nano_miles.algo import admission
from nano_miles.algo.advantages import has_signal
from nano_miles.algo.diagnostics import StepStats
from nano_miles.observe.metrics import TrainerMetrics
from nano_miles.observe.run_record import (RunRecord, StepRecord, format_step_line, ledger_report, step_phases,
                                           summarize)
from nano_miles.run import liveness
from nano_miles.run.config import Config
from nano_miles.run.identity import ensure_run_identity, refuse_another_split, write_run_identity
from nano_miles.run.process import StopRequested
from nano_miles.stages.trainer import lora
from nano_miles.stages.trainer.checkpoint import (TrainerState, load_newest, load_resume_from, num_saves,
                                                  refuse_a_short_disk, save_checkpoint)
from nano_miles.stages.trainer.learner import TrainSample, make_learner
from nano_miles.stages.trainer.peers import Peers
from nano_miles.stages.trainer.ranks import Ranks
from nano_miles.stages.trainer.sharded import Work, gathered_named_tensors
from nano_miles.tasks.prompts import make_decoder
from nano_miles.weights.named_tensors import has_adapters, is_sharded
from nano_miles.wire.codec import WireError, position_of
from nano_miles.wire.control import NO_SIGNAL, ProducerStatus, RestoreState
from nano_miles.wire.data import RolloutGroup, ScoredGroup, decode_scored
from nano_miles.wire.sockets import make_socket

log = logging.getLogger("trainer")

PULL_TIMEOUT_S = 900.0   # no scored group for this long: something upstream is broken for good
CHECK_EVERY_S = 5.0      # while pulling a batch, look after the engine and the producer this often


class Trainer:
    def __init__(self, cfg: Config, ctx: zmq.Context, model, tokenizer, evaluator, split: dict, *,
                 world: int = 1, group=None):
        """`split`: `nano_miles.tasks.split_identity` of the train split the group ids number; `world`,
        `group`: the trainer's ranks and their command group (`ranks.join`), when this is rank 0 of several."""
        self.cfg, self.model, self.tokenizer, self.evaluator = cfg, model, tokenizer, evaluator
        t = cfg.trainer
        self.learner = make_learner(cfg, model, tokenizer)  # before a checkpoint is loaded
        # what needs the whole model goes through here: with several ranks, each takes part
        self.ranks = Ranks(Work(model, self.learner), 0, world, group)
        self.pull = make_socket(ctx, zmq.PULL, t.endpoint, bind=True)
        self.max_staleness = cfg.run.effective_max_staleness
        self.run_dir = cfg.run_dir
        self.state = TrainerState()
        # LoRA: the base model a checkpoint's adapters belong to (hashed once, here)
        self.base = lora.base_identity(cfg.model_dir) if has_adapters(model) else None
        self.resume_from_checkpoint(split)
        self.saved_step = self.step  # the step of the newest checkpoint (0: the base model needs none)
        log.info(refuse_a_short_disk(self.run_dir / "checkpoints", model,  # one line now, not at the last step
                                     num_saves(self.step, t)))
        self.is_stop_requested = False
        self.trained_ids: set[str] = self.state.trained_ids
        self.num_items = split["num_items"]  # group ids <-> dataset positions
        self.metrics = TrainerMetrics(cfg, version=lambda: self.state.version)
        # a sharded model's push: every rank gathers each tensor in turn (in the engine's dtype on a GPU)
        dtype = getattr(torch, cfg.engine.dtype) if self.learner.device.type == "cuda" else None
        self.peers = Peers(cfg, ctx, self.durable_state, run_id=self.state.run_id,
                           on_producer_restart=lambda: self.metrics.restarts.labels("rollout").inc(),
                           on_restored=self.adopt_no_signal, is_stopping=lambda: self.is_stop_requested,
                           gather=(lambda m: gathered_named_tensors(m, self.ranks.tell, dtype)) if is_sharded(model)
                           else None)
        self.dropped: dict[str, int] = {}  # id -> newest attempt refused since the last commit: re-issued
        self.unreported_no_signal: list[str] = []  # consumed untrained since the last commit
        self.drops: dict[str, int] = {}
        self.received_times: list[tuple[float, float, float]] = []  # (issued, generated, received) unix s
        self.last_peer_check = 0.0  # when a pull last looked after the engine and the producer (perf_counter s)
        self.record = RunRecord(cfg, make_decoder(tokenizer, skip_special_tokens=False))
        # what steps a restart redoes generated was spent too: not rolled back with the checkpoint
        self.state.num_generated_tokens = max(self.state.num_generated_tokens, self.record.num_generated_tokens())

    @property
    def step(self) -> int:
        return self.state.step

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        """Every step left, then the summary; after `request_stop`, StopRequested."""
        try:
            self.connect()
            engine_busy_start = self.peers.engine_busy_s()
            if self.lacks_due_evaluation():  # the start of the run, or a step stopped before its evaluation
                self.state.evals.append(self.evaluate())
            while self.step < self.cfg.trainer.num_steps:
                self.take_step()
            return self.finish(engine_busy_start)
        except StopRequested:
            self.checkpoint()
            log.warning("stopped (SIGTERM) after step %d of %d; checkpoint %s", self.step,
                        self.cfg.trainer.num_steps, self.saved_step)
            raise

    def take_step(self) -> None:
        liveness.beat()
        started = time.perf_counter()
        groups, wait_s = self.pull_batch()  # a stop while pulling: nothing of this step happened
        self.state.step += 1  # from here on the model holds it: what `restore` and the version gate count
        stats, advantages = self.optimize(groups)
        self.record.write_rollouts(self.step, groups, advantages)
        self.record.write_samples(self.step, groups, advantages)
        record = self.publish(stats, wait_s)
        record.step_s = time.perf_counter() - started
        record.elapsed_s = self.elapsed_s()
        record.phase_s = step_phases(record, self.received_times)
        self.received_times = []
        log.info(format_step_line(record.to_json(), self.cfg.trainer.num_steps))
        self.metrics.step_done(record)
        self.record.write_step(record)
        if self.is_due(self.cfg.trainer.checkpoint_every):
            self.checkpoint()
        self.stop_if_requested()

    def publish(self, stats: StepStats, wait_s: float) -> StepRecord:
        """Commit, push the weights, evaluate when due: the step's record. After a stop request none of it
        starts and a wait for a peer ends (its stop is ours): the restart's `connect` and
        `lacks_due_evaluation` do what is left."""
        evaluation, eval_s = None, 0.0
        try:
            self.stop_if_requested()
            self.commit(self.step, self.state.trained_by_step[self.step])
            # after the last step the producer is not resumed: nothing more will be trained
            stats.update_ms = 1000 * self.peers.update_weights(
                self.model, self.step, tell_producer=self.step < self.cfg.trainer.num_steps)
            if self.is_due(self.cfg.trainer.eval_every):
                self.stop_if_requested()
                eval_started = time.perf_counter()
                evaluation = self.evaluate()
                eval_s = time.perf_counter() - eval_started  # part of this step, not training
                self.state.evals.append(evaluation)
        except StopRequested:
            log.warning("stopping: step %d is trained; its commit, push and evaluation are left to the restart",
                        self.step)
        self.state.version = self.step  # the weights' version, served now or pushed at the restart
        record = self.step_record(stats, wait_s)
        record.evaluation, record.eval_s = evaluation, eval_s
        return record

    def is_due(self, every: int) -> bool:
        return self.step == self.cfg.trainer.num_steps or (every > 0 and self.step % every == 0)

    def lacks_due_evaluation(self) -> bool:
        return (self.step == 0 or self.is_due(self.cfg.trainer.eval_every)) \
            and all(e["step"] != self.step for e in self.state.evals)

    def checkpoint(self) -> None:
        """Save the state after the last step trained, unless the newest checkpoint holds it already."""
        if self.step != self.saved_step:
            save_checkpoint(self.run_dir / "checkpoints", self.model, self.tokenizer, self.learner, self.state, self.base,
                            save=lambda directory: self.ranks.together("save", str(directory)))
            self.saved_step = self.step

    def request_stop(self) -> None:  # SIGTERM's handler: a flag, read where stopping is safe
        self.is_stop_requested = True

    def stop_if_requested(self) -> None:
        if self.is_stop_requested:
            raise StopRequested(f"stop requested at step {self.step}")

    # ------------------------------------------------------------------ start and end
    def resume_from_checkpoint(self, split: dict) -> None:
        """The newest checkpoint of this run directory that verifies; else `trainer.resume_from`
        (a checkpoint, or the newest of a run directory), whose run this one continues; else a fresh
        start. So a restarted trainer always picks up its own newest step, never resume_from again.
        A checkpoint made under another train split is refused (`refuse_another_split`)."""
        def load(path: Path, saved: dict) -> None:
            self.ranks.together("load", str(path), self.base, saved=saved)

        loaded = load_newest(self.run_dir / "checkpoints", self.model, self.learner, self.base, load=load)
        is_continued = loaded is None and bool(self.cfg.trainer.resume_from)
        if is_continued:
            loaded = load_resume_from(Path(self.cfg.trainer.resume_from), self.model, self.learner, self.base,
                                      load=load)
        if loaded is not None:
            path, self.state = loaded
            refuse_another_split(self.state.split, split, path)
            if is_continued:
                write_run_identity(self.run_dir, self.state.run_id, self.state.started_at)
            log.warning("resuming run %s from step %d of %d (%s; %d groups trained)", self.state.run_id, self.step,
                        self.cfg.trainer.num_steps, path, len(self.state.trained_ids))
        else:
            self.state.run_id, self.state.started_at = ensure_run_identity(self.run_dir)
            log.info("starting run %s in %s", self.state.run_id, self.run_dir)
        self.state.split = split  # also into a checkpoint made before the split was recorded

    def elapsed_s(self) -> float:
        """Wall time since the run started, time lost to restarts included."""
        return time.time() - self.state.started_at

    def connect(self) -> None:
        """Handshake: engine healthy and serving our weights, producer restored and resumed."""
        self.peers.wait_for_engine(600)
        self.peers.update_weights(self.model, self.state.version, tell_producer=False)
        self.peers.request("status")
        self.peers.restore()
        log.info("pipeline connected: engine %s, producer %s, step %d, version %d", self.cfg.engine.url,
                 self.cfg.rollout.control_endpoint, self.step, self.state.version)

    def durable_state(self) -> RestoreState:
        """What `restore` gives a (re)started producer: the checkpointed truth of this trainer."""
        return RestoreState(step=self.step, version=self.state.version,
                            committed_group_ids=sorted(self.trained_ids), cursor=self.state.cursor,
                            num_generated_tokens=self.state.num_generated_tokens,
                            no_signal_group_ids=sorted(self.state.no_signal_ids))

    def adopt_no_signal(self, restored: ProducerStatus) -> None:
        """Take back the groups a previous incarnation skipped after its last checkpoint: the producer
        kept them (as dropped for good) and lists them only in its reply to `restore`."""
        self.state.no_signal_ids |= {g for g, why in restored.dropped_for_good.items() if why == NO_SIGNAL}

    def finish(self, engine_busy_start: float | None) -> dict:
        status = self.peers.request("status")
        dropped_for_good = {**dict.fromkeys(self.state.no_signal_ids, NO_SIGNAL), **status.dropped_for_good}
        report = ledger_report(self.state, status.outstanding_group_ids, self.num_items, dropped_for_good)
        steps = self.record.steps(self.step)
        summary = summarize(steps, self.state.evals)
        wall_s = self.elapsed_s()
        busy_end = self.peers.engine_busy_s()
        summary.update(wall_s=wall_s, ledger={k: v for k, v in report.items() if k.startswith("num_")},
                       engine_final_version=self.peers.with_engine(
                           "final check", lambda: self.peers.engine.model_info()["weight_version"]),
                       final_parity=self.final_parity(),
                       weight_transport=self.peers.sender.transport,
                       engine_repushes=self.peers.num_engine_repushes,
                       producer_restores=self.peers.num_producer_restores,
                       trainer_idle_fraction=sum(r["wait_s"] for r in steps) / wall_s,
                       engine_idle_fraction=(None if busy_end is None or engine_busy_start is None
                                             else 1 - (busy_end - engine_busy_start) / wall_s))
        self.record.finish(steps, summary, report)
        log.info("summary: %s", json.dumps({k: v for k, v in summary.items() if k != "evals"}))
        return summary

    # ------------------------------------------------------------------ stages of a step
    def pull_batch(self) -> tuple[list[ScoredGroup], float]:
        """Pull until `batch_groups` groups pass the admission rules (`nano_miles/algo/admission.py`),
        then put them in dataset order; every refused group is counted by its reason."""
        step = self.step + 1  # the step this batch is for
        started = self.last_peer_check = time.perf_counter()
        batch: list[ScoredGroup] = []
        batch_ids: set[str] = set()
        while len(batch) < self.cfg.trainer.batch_groups:
            self.stop_if_requested()  # between two groups: what is received so far is issued again
            scored = self.receive(started, len(batch))
            if scored is None:
                continue
            group = scored.group
            reason = admission.refusal(
                step, oldest_version=group.oldest_version,
                newest_version=group.newest_version,
                is_consumed=group.group_id in self.trained_ids or group.group_id in self.state.no_signal_ids
                or group.group_id in batch_ids, max_staleness=self.max_staleness,
                has_signal=has_signal(scored.rewards), skip_zero_variance=self.cfg.trainer.skip_zero_variance)
            if reason is None:
                self.metrics.staleness.observe(admission.staleness(step, group.oldest_version))
                batch.append(scored)
                batch_ids.add(group.group_id)
            else:
                self.refuse(group, reason)
        # dataset order, not arrival order: the same groups make the same float sums, so two runs
        # with one seed take the same step
        batch.sort(key=lambda sg: position_of(sg.group.group_id, self.num_items))
        return batch, time.perf_counter() - started

    def receive(self, started: float, num_have: int) -> ScoredGroup | None:
        """One scored group of this run, or None after a second without one. While a batch is pulled it looks
        after the engine and the producer every CHECK_EVERY_S, and gives up after PULL_TIMEOUT_S."""
        liveness.beat("scored groups")
        if self.dropped or self.unreported_no_signal:
            # report at once: until it hears, the producer counts them against its version gate,
            # and in sync mode it issues no replacement
            self.commit(self.step, [])
        is_silent = not self.pull.poll(1000, zmq.POLLIN)
        waited = time.perf_counter() - started
        if is_silent and waited > PULL_TIMEOUT_S:
            raise TimeoutError(f"no scored groups for {waited:.0f}s (have {num_have})")
        # also while groups arrive: a restarted engine's stale groups may never leave a silent second
        if time.perf_counter() - self.last_peer_check > CHECK_EVERY_S:
            log.info("%s scored groups: %d/%d after %.0fs; checking engine and producer",
                     "waiting for" if is_silent else "pulling", num_have, self.cfg.trainer.batch_groups, waited)
            self.peers.check_peers(self.model, self.state.version)
            self.last_peer_check = time.perf_counter()
        if is_silent:
            return None
        try:
            scored = decode_scored(self.pull.recv())
        except WireError as e:
            self.count_drop("malformed")
            log.warning("dropped a malformed message: %s", e)
            return None
        group = scored.group
        if group.run_id != self.state.run_id:  # a leftover stage of another run: not ours to count
            self.count_drop("foreign_run")
            log.warning("dropped group %s of run %s (this run is %s)", group.group_id, group.run_id,
                        self.state.run_id)
            return None
        # Nothing a peer sends changes durable state (the cursor) before it is trained.
        self.metrics.received(scored)
        stamps = group.timestamps
        self.received_times.append((stamps.get("issued", 0.0), stamps.get("generated", 0.0), time.time()))
        return scored

    def refuse(self, group: RolloutGroup, reason: str) -> None:
        """Count a refused group; the producer issues a stale or future one again, not a consumed one."""
        group_id = group.group_id
        self.count_drop(reason)
        if reason == admission.NO_SIGNAL:
            # nothing to learn from: consumed, the ledger keeps it as such, and it is never issued again
            self.state.no_signal_ids.add(group_id)
            self.unreported_no_signal.append(group_id)
            self.advance_cursor([group_id])
        elif reason != admission.DUPLICATE:  # a duplicate is consumed already: nothing to re-issue
            self.dropped[group_id] = max(group.attempt, self.dropped.get(group_id, 0))

    def optimize(self, groups: list[ScoredGroup]) -> tuple[StepStats, list]:
        """Train the step's groups: its statistics, and each group's advantages (the learner makes them)."""
        samples = [TrainSample(sg.group.prompt_tokens, sample.response_tokens, sample.logprobs, float(reward), g,
                               sample.finish_reason, sample.model_mask)
                   for g, sg in enumerate(groups) for sample, reward in zip(sg.group.samples, sg.rewards)]
        result, advantages = self.ranks.together("step", samples)
        if result.num_skipped_steps:
            log.warning("step %d: %d optimizer step(s) skipped, gradient norm not finite; the weights are "
                        "those of before them", self.step, result.num_skipped_steps)
        ids = [sg.group.group_id for sg in groups]
        self.state.trained_by_step[self.step] = ids
        self.trained_ids.update(ids)
        self.advance_cursor(ids)
        self.state.num_trained_tokens += result.num_tokens
        ends = np.cumsum([len(sg.rewards) for sg in groups])[:-1]
        return StepStats.from_groups(groups, self.step, result, advantages), np.split(advantages, ends)

    def advance_cursor(self, group_ids: list[str]) -> None:
        self.state.cursor = max([self.state.cursor] + [position_of(g, self.num_items) + 1 for g in group_ids])

    def evaluate(self) -> dict:
        """The held-out evaluation of the served weights (`evaluate.EvalResult.as_dict`)."""
        result = self.peers.with_engine("evaluation",
                                        lambda: self.evaluator(self.peers.engine, self.step, self.elapsed_s()))
        log.info("held-out at step %d: %s", self.step, result.describe())
        return result.as_dict()

    def final_parity(self) -> float:
        """max |log p| gap between the engine's prefill scores and this model on one probe sample:
        the served weights must be exactly the trained ones at the end."""
        probe = list(range(3, 40))
        mine = self.ranks.together("probe", probe)
        served = self.peers.with_engine("final check", lambda: self.peers.engine.score(probe[:1], probe[1:]))
        return float((torch.tensor(served) - mine).abs().max())

    # ------------------------------------------------------------------ bookkeeping
    def step_record(self, stats: StepStats, wait_s: float) -> StepRecord:
        """The step's record so far; queue depth and goodput come from the producer's last status.

        Queue depth = groups the producer has sent downstream that are neither trained nor dropped
        yet (in reward or in the trainer's buffers); it survives restarts of either side."""
        p = self.peers.producer  # set since `connect`: every control reply carries it
        generated = self.state.num_generated_tokens = p.num_generated_tokens
        return StepRecord(step=self.step, version=self.state.version, stats=stats, wait_s=wait_s,
                          update_split_ms=self.peers.update_split_ms,
                          queue_depth=p.num_outstanding - p.num_inflight,
                          goodput=self.state.num_trained_tokens / generated if generated else None,
                          num_generated_tokens=generated,
                          num_resumed_samples=p.num_resumed_samples,
                          group_ids=self.state.trained_by_step[self.step], drops=dict(self.drops))

    def count_drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.metrics.drops.labels(reason).inc()

    def commit(self, step: int, group_ids: list[str]) -> None:
        """Tell the producer what step `step` trained, and what was refused or consumed untrained since
        the last commit."""
        dropped = {g: attempt for g, attempt in sorted(self.dropped.items()) if g not in self.trained_ids}
        no_signal, self.dropped, self.unreported_no_signal = sorted(self.unreported_no_signal), {}, []
        self.peers.request("commit", step=step, group_ids=group_ids, dropped_attempts=dropped,
                           no_signal_group_ids=no_signal)
