"""The trainer's peers: the engine (weights, evaluation) and the rollout producer (control channel).

Library module used by the step loop (`step_loop.py`). Every call here survives the other side restarting:

* the producer restarted (its incarnation changed) -> `restore` the trainer's durable state, `resume`;
* the engine restarted (it serves base weights again) -> push the current weights before anything;
* the engine or producer is down -> wait for it, with a log line naming what is awaited, up to a
  deadline; past it, raise, so that the trainer exits non-zero and supervisord restarts it; at once,
  with StopRequested, when the trainer is stopping (`is_stopping`): a shutdown stops every stage.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import zmq

from nano_miles.engine.client import EngineClient, EngineError, has_prefix_cache, is_permanent, keeps_requests
from nano_miles.engine.group import make_engine
from nano_miles.run import liveness
from nano_miles.run.config import Config
from nano_miles.run.process import StopRequested
from nano_miles.stages.trainer.memory_plan import engine_fraction
from nano_miles.weights.broadcast_group import WeightTransportError
from nano_miles.weights.broadcast_sender import BroadcastSender
from nano_miles.weights.tensor_sender import TensorSender
from nano_miles.wire.control import ProducerStatus, RestoreState
from nano_miles.wire.sockets import ControlClient, ControlTimeout

log = logging.getLogger("trainer")

PEER_TIMEOUT_S = 600.0   # how long the trainer waits for a dead engine or producer to come back


def wait_for_engine_share(cfg: Config, poll_s: float = 1.0) -> None:
    """Until the SGLang this run starts beside a CUDA trainer answers /health, before the trainer takes GPU
    memory of its own. SGLang sizes its static share from the memory free when its model loads
    (nano_miles/engine/launch.py, `sglang_fraction`); a trainer that loaded first would shrink that share
    below what the memory plan leaves it, or below SGLang's own weights (on an 80 GB card, a 3B trainer
    loading its policy and a bench holding 12.8 GB left SGLang at 0.1 too little for its weights). Once
    SGLang answers, its share is reserved. Waits PEER_TIMEOUT_S, beating meanwhile; TimeoutError after."""
    if not (engine_fraction(cfg) and cfg.trainer.device.startswith("cuda")):
        return
    engine, deadline = make_engine(cfg.engine), time.monotonic() + PEER_TIMEOUT_S
    log.info("waiting for SGLang to take its share of the GPU before loading the policy")
    while not engine.health():
        liveness.beat("the engine to take its share of the GPU")
        if time.monotonic() > deadline:
            raise TimeoutError(f"SGLang did not answer /health in {PEER_TIMEOUT_S:.0f} s (see engine.log)")
        time.sleep(poll_s)


def make_sender(cfg: Config, engine):
    """The weight transport the config asks for; every one has `push(model, version, flush_cache=)`
    and `close()` (drop state an engine restart invalidates)."""
    e = cfg.engine
    if e.weight_transport == "distributed":
        return BroadcastSender([EngineClient(u, timeout_s=e.request_timeout_s) for u in e.engine_urls],
                               backend=e.weight_group_backend, master_address=e.weight_group_address,
                               master_port=e.weight_group_port, timeout_s=e.weight_group_timeout_s)
    return TensorSender(engine, engine_dtype=e.dtype)


class Peers:
    def __init__(self, cfg: Config, ctx: zmq.Context, durable_state: Callable[[], RestoreState], *,
                 run_id: str, on_producer_restart: Callable[[], None] = lambda: None,
                 on_restored: Callable[[ProducerStatus], None] = lambda status: None,
                 is_stopping: Callable[[], bool] = lambda: False, gather: Callable | None = None):
        t = cfg.trainer
        self.cfg = cfg
        self.engine = make_engine(cfg.engine)  # several engines: control calls reach each one
        self.sender = make_sender(cfg, self.engine)
        self.control = ControlClient(ctx, cfg.rollout.control_endpoint, run_id=run_id,
                                     timeout_s=t.control_timeout_s, retries=t.control_retries, give_up=is_stopping)
        self.durable_state = durable_state  # the trainer's durable state, as `restore` sends it
        self.on_producer_restart = on_producer_restart
        self.on_restored = on_restored      # the producer's reply to `restore`, its whole ledger of drops
        self.is_stopping = is_stopping      # the trainer is stopping: no wait for a peer
        self.gather = gather                # a sharded model's (name, full tensor) pairs, all ranks in step
        self.version = -1                   # what the engine serves, as far as we know
        self.producer: ProducerStatus | None = None  # from the producer's last reply
        self.update_split_ms: dict[str, float] = {}
        self.num_engine_repushes = 0
        self.num_producer_restores = 0

    # ------------------------------------------------------------------ producer
    def request(self, cmd: str, **args) -> ProducerStatus:
        """A control command that waits out a restarting producer and restores a restarted one."""
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while True:
            try:
                result = self.control.request(cmd, **args)
                break
            except ControlTimeout:
                self.stop_waiting_if_stopping(f"the rollout producer ({cmd})")
                if time.monotonic() > deadline:
                    raise
                liveness.beat("the rollout producer")
                log.warning("waiting for the rollout producer at %s (%s)", self.cfg.rollout.control_endpoint, cmd)
        status = ProducerStatus.from_result(result)
        if self.control.is_server_restarted:
            self.control.is_server_restarted = False
            log.warning("the rollout producer restarted (new incarnation): restoring it")
            self.on_producer_restart()
            status = self.restore()
        self.producer = status
        return status

    def restore(self) -> ProducerStatus:
        """Give a (re)started producer the trainer's truth and let it generate again."""
        self.num_producer_restores += 1
        state = self.durable_state()
        log.info("restoring the producer: step %d, %d groups trained", state.step, len(state.committed_group_ids))
        self.on_restored(self.request("restore", state=state))
        return self.request("resume", version=self.version)

    # ------------------------------------------------------------------ engine
    def with_engine(self, what: str, fn: Callable):
        """Run `fn()`; if the engine is down or failing, wait for it and try again (bounded). A generation
        request the engine refused (`is_permanent`) is raised at once: it would be refused again."""
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while True:
            try:
                return fn()
            except (EngineError, OSError, WeightTransportError) as e:
                if is_permanent(e) or time.monotonic() > deadline:
                    raise
                log.warning("engine failed during %s (%s); waiting for it", what, e)
                self.wait_for_engine(max(1.0, deadline - time.monotonic()))

    def wait_for_engine(self, timeout_s: float) -> None:
        """Until the engine answers /health; beating meanwhile: waiting for a peer is not a hang."""
        deadline = time.monotonic() + timeout_s
        while True:
            liveness.beat("the engine")
            self.stop_waiting_if_stopping("the engine")
            try:
                return self.engine.wait_until_healthy(min(10.0, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def stop_waiting_if_stopping(self, what: str) -> None:
        if self.is_stopping():
            raise StopRequested(f"stopped while waiting for {what}")

    def update_weights(self, model, version: int, *, tell_producer: bool = True) -> float:
        """pause -> push weights tagged `version` -> resume; returns seconds taken.

        The split (pause / gather / serialize / apply / resume) is kept in `self.update_split_ms`."""
        mode = self.cfg.run.pause_mode
        t0 = time.perf_counter()
        # Sync mode with nothing in flight (the version gate holds the producer until `resume`):
        # there is nothing to pause, so the update skips two round trips to each side.
        is_idle = (self.cfg.run.mode == "sync" and tell_producer
                   and self.producer is not None and self.producer.num_inflight == 0)
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
        # kept requests hold KV: SGLang cannot flush then; an engine without a prefix cache never needs to
        flush_cache = (is_idle or not keeps_requests(mode)) and has_prefix_cache(self.engine)
        if self.gather is None:
            push = self.sender.push(model, version, flush_cache=flush_cache)
        else:  # closed even when the push fails: the other ranks finish the gathers with this one
            with contextlib.closing(self.gather(model)) as named:
                push = self.sender.push(model, version, flush_cache=flush_cache, named=named)
        t2 = time.perf_counter()
        if not is_idle:
            self.engine.resume()
        self.version = version
        return {"pause": t1 - t0, "resume": time.perf_counter() - t2,
                **{k[:-2]: v for k, v in push.items() if k != "total_s"}}

    def check_peers(self, model, version: int) -> None:
        """While waiting for data: restore a restarted producer, then weights on a restarted engine. In this
        order because a producer is resumed at `version` and generates at once: an engine that restarted
        while the trainer waited for the producer must serve `version` again before the first request."""
        self.request("status")
        try:
            served = self.engine.weight_version()
        except (EngineError, OSError):
            log.warning("engine at %s is not answering; waiting for it", self.cfg.engine.url)
            served = version  # nothing to restore until it answers
        if served != version:
            log.warning("engine serves weight version %s, expected %d (restarted?): pushing weights again",
                        served, version)
            self.num_engine_repushes += 1
            self.sender.close()  # e.g. the restarted engine left the weight group
            self.update_weights(model, version)

    def engine_busy_s(self) -> float | None:
        """Seconds the engine spent in forward passes (the local engine reports it; SGLang not)."""
        try:
            states = self.engine.server_info().get("internal_states") or [{}]
        except (EngineError, OSError):
            return None
        return states[0].get("busy_s")
