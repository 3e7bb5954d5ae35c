"""The trainer's link to the rest of the pipeline: engine weights and the producer's control channel.

Library module used by `nano_miles/trainer.py`. Every call here survives the other side restarting:

* the producer restarted (its incarnation changed) -> `sync` the trainer's durable state, `resume`;
* the engine restarted (it serves base weights again) -> push the current weights before anything;
* the engine or producer is down -> wait for it, with a log line naming what is awaited, up to a
  deadline; past it, raise, so that the trainer exits non-zero and supervisord restarts it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from nano_miles.channels import ControlClient, ControlTimeout
from nano_miles.config import Config, keeps_requests
from nano_miles.dist_sync import DistributedWeightSender, WeightTransportError
from nano_miles.engine_client import EngineClient, EngineError
from nano_miles.engine_group import make_engine
from nano_miles.weight_sync import push_weights

log = logging.getLogger("trainer")

PEER_TIMEOUT_S = 600.0   # how long the trainer waits for a dead engine or producer to come back


class PipelineLink:
    def __init__(self, cfg: Config, ctx: zmq.Context, sync_state: Callable[[], dict]):
        t = cfg.trainer
        self.cfg = cfg
        self.engine = make_engine(cfg.engine)  # several engines: control calls reach each one
        self.sender = None  # the broadcast transport, when the config asks for it
        if cfg.engine.weight_transport == "distributed":
            e = cfg.engine
            self.sender = DistributedWeightSender(
                [EngineClient(u, timeout_s=e.request_timeout_s) for u in e.engine_urls],
                backend=e.weight_group_backend, master_address=e.weight_group_address,
                master_port=e.weight_group_port, timeout_s=e.weight_group_timeout_s)
        self.control = ControlClient(ctx, cfg.rollout.control_endpoint, timeout_s=t.control_timeout_s,
                                     retries=t.control_retries)
        self.sync_state = sync_state      # the trainer's durable state, as `sync` sends it
        self.version = -1                 # what the engine serves, as far as we know
        self.producer: dict = {}          # the producer's counters from its last reply
        self.update_split_ms: dict[str, float] = {}
        self.num_engine_repushes = 0
        self.num_producer_resyncs = 0

    # ------------------------------------------------------------------ producer
    def request(self, cmd: str, **args) -> dict:
        """A control command that waits out a restarting producer and re-syncs a restarted one."""
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while True:
            try:
                result = self.control.request(cmd, **args)
                break
            except ControlTimeout:
                if time.monotonic() > deadline:
                    raise
                log.warning("waiting for the rollout producer at %s (%s)", self.cfg.rollout.control_endpoint, cmd)
        if self.control.is_server_restarted:
            self.control.is_server_restarted = False
            log.warning("the rollout producer restarted (new incarnation): re-syncing it")
            self.resync()
        self.producer = {k: v for k, v in result.items() if k.startswith("num_")} or self.producer
        return result

    def resync(self) -> None:
        """Give a (re)started producer the trainer's truth and let it generate again."""
        self.num_producer_resyncs += 1
        state = self.sync_state()
        log.info("syncing the producer: step %d, %d groups trained", state["step"],
                 len(state["committed_group_ids"]))
        self.request("sync", state=state)
        self.producer = self.request("resume", version=self.version)

    # ------------------------------------------------------------------ engine
    def with_engine(self, what: str, fn: Callable):
        """Run `fn()`; if the engine is down or failing, wait for it and try again (bounded)."""
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while True:
            try:
                return fn()
            except (EngineError, OSError, WeightTransportError) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("engine failed during %s (%s); waiting for it", what, e)
                self.engine.wait_until_healthy(max(1.0, deadline - time.monotonic()))

    def update_weights(self, model, version: int, *, tell_producer: bool = True) -> float:
        """pause -> push weights tagged `version` -> resume; returns seconds taken.

        The split (pause / gather / serialize / apply / resume) is kept in `self.update_split_ms`."""
        mode = self.cfg.run.pause_mode
        t0 = time.perf_counter()
        # Sync mode with nothing in flight (the version gate holds the producer until `resume`):
        # there is nothing to pause, so the update skips two round trips to each side.
        is_idle = (self.cfg.run.mode == "sync" and tell_producer
                   and self.producer.get("num_inflight", 1) == 0)
        # A kept request needs nothing from the producer, and the engine queues new ones while
        # paused: only an abort needs the producer to stop and collect its partial samples first.
        if tell_producer and not is_idle and not keeps_requests(mode):
            self.request("pause", mode=mode)
        times = self.with_engine("weight update", lambda: self._push(model, version, mode, is_idle))
        if tell_producer:
            self.request("resume", version=version)
        t3 = time.perf_counter()
        self.update_split_ms = {k: 1000 * v for k, v in times.items()}
        return t3 - t0

    def _push(self, model, version: int, mode: str, is_idle: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        if not is_idle:
            self.engine.pause(mode)
        t1 = time.perf_counter()
        flush_cache = is_idle or not keeps_requests(mode)  # kept requests hold KV: SGLang cannot flush then
        if self.sender is not None:  # a failed push dropped the group; this one builds a new one
            push = self.sender.push(model, version, flush_cache=flush_cache)
        else:
            push = push_weights(self.engine, model, version, flush_cache=flush_cache)
        t2 = time.perf_counter()
        if not is_idle:
            self.engine.resume()
        self.version = version
        return {"pause": t1 - t0, "resume": time.perf_counter() - t2,
                **{k[:-2]: v for k, v in push.items() if k != "total_s"}}

    def check_peers(self, model, version: int) -> None:
        """While waiting for data: restore weights on a restarted engine, re-sync a restarted producer."""
        try:
            served = self.engine.model_info().get("weight_version")
        except (EngineError, OSError):
            log.warning("engine at %s is not answering; waiting for it", self.cfg.engine.url)
            served = None
        if served is not None and served != str(version):
            log.warning("engine serves weight version %s, expected %d (restarted?): pushing weights again",
                        served, version)
            self.num_engine_repushes += 1
            if self.sender is not None:  # the restarted engine left the weight group
                self.sender.close()
            self.update_weights(model, version)
        self.request("status")

    def engine_busy_s(self) -> float | None:
        """Seconds the engine spent in forward passes (the local engine reports it; SGLang not)."""
        try:
            states = self.engine.server_info().get("internal_states") or [{}]
        except (EngineError, OSError):
            return None
        return states[0].get("busy_s")
