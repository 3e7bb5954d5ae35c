"""Every Prometheus metric of the pipeline, one class per stage, so that all names live in this file.

Library module; each stage builds its class once and serves it on 127.0.0.1:<section>.metrics_port
(the local engine on its own HTTP port, route /metrics). Read them all with `python -m nano_miles.observe.top`.

Names follow `nanomiles_<thing>_<unit>[_total]`. Hops are named `<from>_to_<to>`; the queue depth of
a hop is `groups_sent_total{hop} - groups_received_total{hop}` read from its two ends, and is exported
directly as a gauge where one process knows it (groups in flight at the engine). Every registry is
private to its process and carries the process collector, so `process_cpu_seconds_total` and
`process_start_time_seconds` (a restart shows as a new start time) come with each stage.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, Summary,
                               start_http_server)

from nano_miles.algo.diagnostics import StepStats, declared

log = logging.getLogger(__name__)

HOP_ENGINE = "rollout_to_engine"
HOP_REWARD = "rollout_to_reward"
HOP_TRAINER = "reward_to_trainer"
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
RATE_WINDOW_S = 10.0  # tokens/s gauges average over this window


class StageMetrics:
    """A private registry with the hop counters; served over HTTP when `port` is non-zero."""

    def __init__(self, stage: str, port: int):
        self.stage = stage
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.groups_sent = Counter("nanomiles_groups_sent", "Groups sent on a hop", ["hop"], registry=r)
        self.groups_received = Counter("nanomiles_groups_received", "Groups received on a hop", ["hop"],
                                       registry=r)
        self.tokens_sent = Counter("nanomiles_tokens_sent", "Response tokens sent on a hop", ["hop"], registry=r)
        self.tokens_received = Counter("nanomiles_tokens_received", "Response tokens received on a hop",
                                       ["hop"], registry=r)
        self.weight_version = Gauge("nanomiles_weight_version", "Weight version this stage works with", registry=r)
        if port:
            start_http_server(port, addr="127.0.0.1", registry=r)
            log.info("metrics on http://127.0.0.1:%d/metrics", port)

    def count(self, direction: str, hop: str, num_tokens: int) -> None:
        groups, tokens = ((self.groups_sent, self.tokens_sent) if direction == "sent"
                          else (self.groups_received, self.tokens_received))
        groups.labels(hop).inc()
        tokens.labels(hop).inc(num_tokens)


def response_tokens(group) -> int:
    """Generated tokens of a RolloutGroup: the model's (neither the prompt nor what a multi-turn
    rollout's environment wrote between turns was generated)."""
    return sum(s.num_model_tokens for s in group.samples)


class TokenRate:
    """Tokens per second over the last RATE_WINDOW_S, for a gauge read at scrape time."""

    def __init__(self):
        self.events: deque[tuple[float, int]] = deque()

    def add(self, num_tokens: int) -> None:
        self.events.append((time.monotonic(), num_tokens))

    def per_second(self) -> float:
        now = time.monotonic()
        while self.events and self.events[0][0] < now - RATE_WINDOW_S:
            self.events.popleft()
        return sum(n for _, n in self.events) / RATE_WINDOW_S


class RolloutMetrics(StageMetrics):
    """Groups to the engine and on to reward; requests in flight read from the producer's state."""

    def __init__(self, cfg, state):
        super().__init__("rollout", cfg.rollout.metrics_port)
        r, group_size = self.registry, cfg.rollout.group_size
        self.rate = TokenRate()
        Gauge("nanomiles_queue_depth_groups", "Groups waiting on a hop (known to this process)", ["hop"],
              registry=r).labels(HOP_ENGINE).set_function(lambda: len(state.inflight))
        Gauge("nanomiles_engine_requests_inflight", "Generate requests awaiting the engine",
              registry=r).set_function(lambda: group_size * len(state.inflight))
        Gauge("nanomiles_rollout_paused", "1 while the producer is paused", registry=r).set_function(
            lambda: float(state.is_paused))
        Gauge("nanomiles_generate_tokens_per_second", "Generated tokens/s over the last 10 s",
              registry=r).set_function(self.rate.per_second)
        self.weight_version.set_function(lambda: state.version)
        self.engine_failures = Counter("nanomiles_engine_failures", "Groups the engine failed (re-issued)",
                                       registry=r)
        self.dropped_for_good = Counter("nanomiles_dropped_for_good_groups", "Groups the engine refused "
                                        "for good (never issued again)", ["reason"], registry=r)
        self.model_turns = Counter("nanomiles_model_turns", "Turns the model wrote (a multi-turn sample has "
                                   "several)", registry=r)
        self.environment_tokens = Counter("nanomiles_environment_tokens", "Tokens a multi-turn rollout's "
                                          "environment wrote between the model's turns (read, not trained)",
                                          registry=r)

    def issued(self) -> None:
        self.groups_sent.labels(HOP_ENGINE).inc()

    def sent(self, group) -> None:
        """A generated group came back from the engine and went on to reward."""
        num_tokens = response_tokens(group)
        self.count("received", HOP_ENGINE, num_tokens)
        self.count("sent", HOP_REWARD, num_tokens)
        self.rate.add(num_tokens)
        self.model_turns.inc(sum(is_model for s in group.samples for _, _, is_model in s.turns))
        self.environment_tokens.inc(sum(len(s.response_tokens) for s in group.samples) - num_tokens)


class RewardMetrics(StageMetrics):
    def __init__(self, cfg):
        super().__init__("reward", cfg.reward.metrics_port)
        self.rejected = Counter("nanomiles_rejected_messages", "Undecodable messages", registry=self.registry)
        self.reward_failures = Counter("nanomiles_reward_failures", "Samples scored 0 because the reward "
                                       "function raised, hung or returned a non-finite value", ["reason"],
                                       registry=self.registry)
        self.busy_seconds = Counter("nanomiles_busy_seconds", "Seconds spent scoring", registry=self.registry)
        self.reward = Summary("nanomiles_reward", "Mean reward per scored group", registry=self.registry)
        self.started_s = 0.0

    def received(self, group) -> None:
        self.started_s = time.perf_counter()
        self.count("received", HOP_REWARD, response_tokens(group))
        self.weight_version.set(group.oldest_version)  # the version the last scored group came from

    def sent(self, scored) -> None:
        self.busy_seconds.inc(time.perf_counter() - self.started_s)
        self.count("sent", HOP_TRAINER, response_tokens(scored.group))
        self.reward.observe(float(scored.rewards.mean()))


class TrainerMetrics(StageMetrics):
    """Staleness, drops, step and weight-update timings, reward, goodput, restarts of peers seen."""

    def __init__(self, cfg, version: Callable[[], int]):
        super().__init__("trainer", cfg.trainer.metrics_port)
        r = self.registry
        self.staleness = Histogram("nanomiles_staleness_versions", "Staleness of accepted groups",
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.drops = Counter("nanomiles_dropped_groups", "Groups dropped by the trainer", ["reason"], registry=r)
        self.step_seconds = Summary("nanomiles_step_seconds", "Wall time of a training step", registry=r)
        self.phase_seconds = Summary("nanomiles_step_phase_seconds", "Step time by phase", ["phase"], registry=r)
        self.update_seconds = Summary("nanomiles_weight_update_seconds", "Weight update time by part", ["part"],
                                      registry=r)
        self.trained_tokens = Counter("nanomiles_trained_tokens", "Response tokens trained on", registry=r)
        self.skipped_steps = Counter("nanomiles_skipped_optimizer_steps", "Optimizer steps skipped for a gradient "
                                     "norm that was not finite", registry=r)
        # the step's diagnostics that name a gauge (nano_miles/algo/diagnostics.py): field -> (gauge, scale)
        self.diagnostics = {f.name: (Gauge(f.metadata["prom"], f.metadata["help"], registry=r), f.metadata["scale"])
                            for f in declared(StepStats) if f.metadata["prom"]}
        self.reward_parts = Gauge("nanomiles_reward_part_mean", "Mean of a reward part in the last batch "
                                  "(per function with reward.fns)", ["part"], registry=r)
        self.eval_accuracy = Gauge("nanomiles_eval_accuracy_ratio", "Last held-out greedy accuracy", registry=r)
        self.eval_reward = Gauge("nanomiles_eval_reward_mean", "Last held-out greedy mean reward", registry=r)
        self.goodput = Gauge("nanomiles_goodput_ratio", "Response tokens in the model / generated, over the "
                             "whole run (from durable counts, so restarts do not skew it)", registry=r)
        self.restarts = Counter("nanomiles_restarts_seen", "Restarts of a peer noticed by the trainer", ["stage"],
                                registry=r)
        self.step = Gauge("nanomiles_step", "Last finished training step", registry=r)
        self.weight_version.set_function(version)

    def received(self, scored) -> None:
        num_tokens = response_tokens(scored.group)
        self.count("received", HOP_TRAINER, num_tokens)

    def step_done(self, record) -> None:
        """Observe one finished step (a `run_record.StepRecord`)."""
        for phase, seconds in record.phase_s.items():
            self.phase_seconds.labels(phase).observe(seconds)
        for part, ms in record.update_split_ms.items():
            self.update_seconds.labels(part).observe(ms / 1000)
        self.step_seconds.observe(record.step_s)
        stats = record.stats.as_dict()
        self.trained_tokens.inc(stats["num_tokens"])
        self.skipped_steps.inc(stats["num_skipped_steps"])
        for name, (gauge, scale) in self.diagnostics.items():
            if stats[name] is not None:  # e.g. a reward function without an accuracy part
                gauge.set(stats[name] * scale)
        for part, value in stats["reward_parts"].items():
            self.reward_parts.labels(part).set(value)
        if record.evaluation is not None:
            if record.evaluation["accuracy"] is not None:
                self.eval_accuracy.set(record.evaluation["accuracy"])
            self.eval_reward.set(record.evaluation["reward"])
        if record.goodput is not None:
            self.goodput.set(record.goodput)
        self.step.set(record.step)


class EngineMetrics:
    """The local engine's metrics, read from its scheduler at scrape time (served on GET /metrics)."""

    def __init__(self, scheduler):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        self.scheduler = scheduler
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.generated = Counter("nanomiles_engine_generated_tokens", "Tokens generated", registry=self.registry)
        self.gauge, self.counter = GaugeMetricFamily, CounterMetricFamily
        self.registry.register(self)

    def collect(self):
        stats = self.scheduler.stats()
        version = str(self.scheduler.weight_version)
        yield self.gauge("nanomiles_engine_running_requests", "Requests in the decode batch",
                         value=stats["num_running_reqs"])
        yield self.gauge("nanomiles_engine_waiting_requests", "Requests queued for admission",
                         value=stats["num_waiting_reqs"])
        yield self.gauge("nanomiles_engine_paused", "1 while generation is paused", value=float(stats["is_paused"]))
        yield self.counter("nanomiles_engine_forward_steps", "Model forward steps", value=stats["num_forward_steps"])
        yield self.gauge("nanomiles_weight_version", "Weight version served",
                         value=float(version) if version.lstrip("-").isdigit() else -1.0)

    def describe(self):
        return []  # names are known only at collect time; registering must not call collect

    def count_generated(self, requests) -> None:
        self.generated.inc(sum(len(r.output_ids) for r in requests))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)
