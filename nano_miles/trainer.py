"""The trainer: pulls scored groups, takes GRPO steps, hot-updates the engine's weights, evaluates.

Run under supervisord as `python procs/trainer.py [--section.key=value ...]`.

The step loop (`Trainer.train`) is the algorithm: pull -> assemble -> loss -> step -> update weights
-> evaluate/checkpoint. The trainer owns the only durable state (policy, optimizer, version) and is
the REQ client of the control channel; it never waits on anything without a timeout.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import zmq

from nano_miles.channels import ControlClient, ControlTimeout, make_socket
from nano_miles.config import Config
from nano_miles.engine_client import EngineClient
from nano_miles.grpo import assemble_batch, token_logprobs
from nano_miles.loss import LossConfig, ppo_loss
from nano_miles.run_log import StepStats, format_step_line, summarize
from nano_miles.weight_sync import push_weights
from nano_miles.wire import ScoredGroup, WireError, decode_scored

log = logging.getLogger("trainer")

PULL_TIMEOUT_S = 900.0      # no scored group for this long: something upstream is broken for good
STARTUP_TIMEOUT_S = 600.0   # engine and producer must answer within this at start


class Trainer:
    def __init__(self, cfg: Config, ctx: zmq.Context, model, evaluator, pad_id: int):
        self.cfg, self.model, self.evaluator, self.pad_id = cfg, model, evaluator, pad_id
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.loss_cfg = LossConfig(t.eps_clip, t.eps_clip_high, t.dual_clip_c)
        self.engine = EngineClient(cfg.engine.url, timeout_s=cfg.engine.request_timeout_s)
        self.control = ControlClient(ctx, cfg.rollout.control_endpoint, timeout_s=t.control_timeout_s,
                                     retries=t.control_retries)
        self.pull = make_socket(ctx, zmq.PULL, t.endpoint, bind=True)
        self.max_staleness = cfg.run.max_staleness if cfg.run.mode == "async" else 0
        self.step = 0
        self.version = 0
        self.update_split_ms: dict[str, float] = {}
        self.trained_ids: set[str] = set()
        self.drops: dict[str, int] = {}
        self.run_dir = cfg.run_dir
        self.metrics_path = self.run_dir / "metrics.jsonl"

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        self.connect()
        self.started = time.perf_counter()
        history = [self.evaluate_into({"step": 0})]
        for self.step in range(self.step + 1, self.cfg.trainer.num_steps + 1):
            started = time.perf_counter()
            groups, wait_s = self.pull_batch()
            stats = self.optimize(groups)
            stats.update_ms = 1000 * self.update_weights(self.step)
            record = {"step": self.step, "version": self.version, "wait_s": wait_s, **stats.as_dict(),
                      "update_split_ms": self.update_split_ms,
                      "group_ids": [g.group.group_id for g in groups]}
            if self.is_due(self.cfg.trainer.eval_every):
                self.evaluate_into(record)
            record["step_s"] = time.perf_counter() - started
            record["elapsed_s"] = time.perf_counter() - self.started
            log.info(format_step_line(record, self.cfg.trainer.num_steps))
            self.append_metrics(record)
            history.append(record)
            if self.is_due(self.cfg.trainer.checkpoint_every):
                self.checkpoint()
        summary = summarize(history)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("summary: %s", json.dumps(summary))
        return summary

    def is_due(self, every: int) -> bool:
        return self.step == self.cfg.trainer.num_steps or (every > 0 and self.step % every == 0)

    # ------------------------------------------------------------------ stages of a step
    def connect(self) -> None:
        """Handshake: engine healthy, its weights = ours, producer synced and resumed."""
        self.engine.wait_until_healthy(STARTUP_TIMEOUT_S)
        self.update_weights(self.version, tell_producer=False)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                self.control.request("status")
                break
            except ControlTimeout:
                if time.monotonic() > deadline:
                    raise
                log.info("waiting for the rollout producer at %s", self.cfg.rollout.control_endpoint)
        state = {"step": self.step, "version": self.version, "committed_group_ids": [],
                 "data_cursor": {"epoch": 0, "index": self.step * self.cfg.trainer.batch_groups}}
        self.control.request("sync", state=state)
        self.control.request("resume", version=self.version)
        log.info("pipeline connected: engine %s, producer %s, version %d", self.cfg.engine.url,
                 self.cfg.rollout.control_endpoint, self.version)

    def pull_batch(self) -> tuple[list[ScoredGroup], float]:
        """Pull until `batch_groups` fresh groups; drop (and count) stale or duplicate ones."""
        started = time.perf_counter()
        batch: list[ScoredGroup] = []
        last_log = started
        while len(batch) < self.cfg.trainer.batch_groups:
            if not self.pull.poll(5000, zmq.POLLIN):
                waited = time.perf_counter() - started
                if waited > PULL_TIMEOUT_S:
                    raise TimeoutError(f"no scored groups for {waited:.0f}s (have {len(batch)})")
                if time.perf_counter() - last_log > 30:
                    log.info("waiting for scored groups from reward: %d/%d after %.0fs",
                             len(batch), self.cfg.trainer.batch_groups, waited)
                    last_log = time.perf_counter()
                continue
            try:
                scored = decode_scored(self.pull.recv())
            except WireError as e:
                self.count_drop("malformed")
                log.warning("dropped a malformed message: %s", e)
                continue
            group = scored.group
            staleness = (self.step - 1) - group.oldest_version
            if group.group_id in self.trained_ids or any(g.group.group_id == group.group_id for g in batch):
                self.count_drop("duplicate")
            elif staleness > self.max_staleness:
                self.count_drop("stale")
            else:
                batch.append(scored)
        return batch, time.perf_counter() - started

    def optimize(self, groups: list[ScoredGroup]) -> StepStats:
        prompts, responses, logprobs, advantages = [], [], [], []
        for sg in groups:
            for sample, adv in zip(sg.group.samples, sg.advantages):
                prompts.append(sg.group.prompt_tokens)
                responses.append(sample.response_tokens)
                logprobs.append(sample.logprobs)
                advantages.append(float(adv))
        batch = assemble_batch(prompts, responses, logprobs, advantages, self.pad_id).to(self.cfg.trainer.device)
        self.model.train()
        logp = token_logprobs(self.model, batch.input_ids, batch.targets, batch.attention_mask,
                              self.cfg.rollout.temperature)
        out = ppo_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, self.loss_cfg)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.max_grad_norm)
        self.optimizer.step()
        self.trained_ids.update(sg.group.group_id for sg in groups)
        return StepStats.from_groups(groups, self.step, out, float(grad_norm))

    def update_weights(self, version: int, *, tell_producer: bool = True) -> float:
        """pause -> push weights tagged `version` -> resume; returns seconds taken.

        The split (pause / gather / serialize / apply / resume) is kept in `self.update_split_ms`."""
        t0 = time.perf_counter()
        if tell_producer:
            self.control.request("pause", mode="abort")
        self.engine.pause("abort")
        t1 = time.perf_counter()
        push = push_weights(self.engine, self.model, version)
        t2 = time.perf_counter()
        self.engine.resume()
        self.version = version
        if tell_producer:
            self.control.request("resume", version=version)
        t3 = time.perf_counter()
        self.update_split_ms = {"pause": 1000 * (t1 - t0), "resume": 1000 * (t3 - t2),
                                **{k[:-2]: 1000 * v for k, v in push.items() if k != "total_s"}}
        return t3 - t0

    def evaluate_into(self, record: dict) -> dict:
        record["eval_accuracy"] = self.evaluator(self.engine)
        record["eval_elapsed_s"] = time.perf_counter() - self.started
        log.info("held-out accuracy at step %d: %.1f%%", self.step, 100 * record["eval_accuracy"])
        return record

    # ------------------------------------------------------------------ bookkeeping
    def count_drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def append_metrics(self, record: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({**record, "drops": dict(self.drops), "time": time.time()}) + "\n")

    def checkpoint(self) -> Path:
        """Weights (safetensors) + optimizer + counters, written to a temp dir and renamed."""
        final = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(tmp)
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step, "version": self.version,
                    "trained_ids": sorted(self.trained_ids)}, tmp / "trainer_state.pt")
        tmp.rename(final)
        return final
