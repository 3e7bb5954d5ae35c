"""The scheduler: one thread that owns the model and runs requests in a continuously changing batch.
Used by `server.py`; run the whole engine with `python -m nano_miles.local_engine --model-path DIR`.

Every loop iteration, at a step boundary: run queued control commands (pause, continue, weight
update), prefill newly admitted requests together (left-padded) and merge their KV into the running
batch, then run one decode step for the whole batch. Finished requests leave the batch right away.
HTTP handler threads only enqueue requests and wait on each request's `done` event.
"""

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from nano_miles.local_engine import kv_batch
from nano_miles.local_engine.kv_batch import KVBatch
from nano_miles.local_engine.sampling import SamplingParams, make_generator, sample_tokens

log = logging.getLogger(__name__)

MAX_PREFILL_TOKENS = 16384  # padded tokens per prefill forward; bounds the memory of a burst of arrivals
IDLE_WAIT_S = 0.5
# A forward of fewer rows takes other matrix kernels on the CPU, whose sums differ in the last bits:
# small batches are padded with copies, so a row's logits, and a seeded request's draws, do not
# depend on how many others share its batch (see also kv_batch.py). Where the kernels switch depends
# on the CPU and the shape: below 4 rows on one machine; below 16 rows for the MLP's down projection
# (K = 384) under MKL's AVX-512 kernels on another (rows of 8..15 and of 16+ differ; 16+ agree).
MIN_ROWS = 16


class SchedulerStopped(RuntimeError):
    """The scheduler thread is not running (shut down or crashed)."""


class StepBoundaryTimeout(TimeoutError):
    """A control command found no step boundary in time; its own type, so the HTTP layer tells it
    from a socket timeout."""


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1 = no input logprobs
    received_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list | None = None  # entries of docs/sglang-contract.md §2.3, from the first prefill
    finish_reason: dict | None = None
    weight_version: str = ""  # version at emission time, as SGLang reports it
    # [{"version", "start", "end"}] over output-token indices, as SGLang 0.5.23 reports them: a
    # request kept across a weight update (retract / in_place) spans two versions
    version_spans: list[dict] = field(default_factory=list)
    e2e_latency_s: float = 0.0
    num_retractions: int = 0
    generator: torch.Generator | None = None
    done: threading.Event = field(default_factory=threading.Event)
    responded: threading.Event = field(default_factory=threading.Event)

    @property
    def is_input_logprob_pending(self) -> bool:
        return self.return_logprob and self.input_logprobs is None


@dataclass(eq=False)
class _Control:
    fn: Callable
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: ValueError | None = None


class Scheduler:
    def __init__(self, model, eos_token_ids: set[int], weight_version: str, max_running_requests: int,
                 device: str):
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.weight_version = weight_version
        self.max_running_requests = max_running_requests
        self.device = torch.device(device)
        self.max_batch_size_seen = 0
        self.num_forward_steps = 0
        self.busy_s = 0.0
        self.is_paused = False
        self._cache_kwarg = kv_batch.cache_kwarg_name(model)
        self._cond = threading.Condition()
        self._waiting: list[Request] = []
        self._controls: list[_Control] = []
        self._active: dict[str, Request] = {}  # every submitted request until its handler released it
        self._running: list[Request] = []  # rows of self._batch, in order
        self._batch: KVBatch | None = None
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    # ---- called from handler threads ----
    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, reqs: list[Request]) -> None:
        """Queue requests; raises ValueError for a duplicate in-flight rid (-> HTTP 400)."""
        with self._cond:
            if not self.is_alive:
                raise SchedulerStopped("the engine's scheduler is not running")
            counts = Counter(r.rid for r in reqs)
            duplicates = {rid for rid, n in counts.items() if n > 1 or rid in self._active}
            if duplicates:
                raise ValueError(f"Duplicate request ID detected: {sorted(duplicates)}")
            for r in reqs:
                r.generator = make_generator(r.params, self.device)
                self._active[r.rid] = r
            self._waiting.extend(reqs)
            self._cond.notify_all()

    def wait(self, req: Request) -> None:
        """Block until `req` finished; the scheduler finishes every request even when it crashes."""
        while not req.done.wait(timeout=1.0):
            if not self.is_alive:
                raise SchedulerStopped("the engine's scheduler stopped")

    def retire(self, reqs: list[Request]) -> None:
        """These requests' rids are free again: their answer is about to be written, and a client may
        send the next request under the same rid as soon as it has read it."""
        with self._cond:
            for r in reqs:
                self._active.pop(r.rid, None)

    def release(self, reqs: list[Request]) -> None:
        """The handler is done with these requests (response written or abandoned)."""
        self.retire(reqs)
        for r in reqs:
            r.responded.set()

    def run_in_loop(self, fn: Callable, timeout_s: float):
        """Run `fn()` on the scheduler thread at the next step boundary and return its result.

        A ValueError from `fn` is re-raised here; anything else crashes the scheduler (fail loud)."""
        control = _Control(fn)
        with self._cond:
            if not self.is_alive:
                raise SchedulerStopped("the engine's scheduler is not running")
            self._controls.append(control)
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        while not control.done.wait(timeout=1.0):
            if not self.is_alive:
                raise SchedulerStopped("the engine's scheduler stopped")
            if time.monotonic() > deadline:
                raise StepBoundaryTimeout(f"the scheduler did not reach a step boundary within {timeout_s}s")
        if control.error is not None:
            raise control.error
        return control.result

    def stats(self) -> dict:
        with self._cond:
            return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting),
                    "max_batch_size_seen": self.max_batch_size_seen,
                    "num_forward_steps": self.num_forward_steps, "busy_s": self.busy_s,
                    "is_paused": self.is_paused}

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._is_stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    # ---- control commands: run on the scheduler thread via run_in_loop ----
    def pause(self, mode: str) -> list[Request]:
        """Stop stepping. abort: finish every request now (returned); retract: drop the KV, keep tokens,
        recompute on resume; in_place: keep everything as is."""
        aborted = []
        if mode == "abort":
            aborted = self._running + self._take_waiting()
            for r in self._running:
                self._finish(r, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
            for r in aborted[len(self._running):]:
                self._finish(r, {"type": "abort", "message": "Abort in waiting queue"})
            self._running, self._batch = [], None
        elif mode == "retract":
            for r in self._running:
                r.num_retractions += 1
            with self._cond:
                self._waiting[:0] = self._running
            self._running, self._batch = [], None
        self.is_paused = True
        return aborted

    def resume(self) -> None:
        self.is_paused = False

    # ---- the loop ----
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._is_stopping or self._controls
                               or (not self.is_paused and (self._waiting or self._running))):
                        self._cond.wait(timeout=IDLE_WAIT_S)
                    if self._is_stopping:
                        return
                    controls, self._controls = self._controls, []
                for control in controls:
                    try:
                        control.result = control.fn()
                    except ValueError as e:
                        control.error = e
                    control.done.set()
                if self.is_paused:
                    continue
                self._admit()
                if self._running:
                    self._decode()
        finally:
            # shutdown or crash: no handler may wait forever
            with self._cond:
                pending = self._running + self._waiting
                self._waiting, self._controls, self._running, self._batch = [], [], [], None
            for r in pending:
                if not r.done.is_set():
                    self._finish(r, {"type": "abort", "message": "engine stopped", "status_code": None,
                                     "err_type": None})

    def _take_waiting(self, max_num: int | None = None) -> list[Request]:
        with self._cond:
            num = len(self._waiting) if max_num is None else min(max_num, len(self._waiting))
            taken, self._waiting = self._waiting[:num], self._waiting[num:]
            return taken

    def _forward(self, input_ids, mask, position_ids, kv, num_logits: int):
        started_s = time.perf_counter()
        num_rows = input_ids.shape[0]
        if num_rows < MIN_ROWS:
            pad = torch.full((MIN_ROWS - num_rows,), num_rows - 1)  # copies of the last row, dropped after
            rows = torch.cat([torch.arange(num_rows), pad])
            input_ids, mask, position_ids = input_ids[rows], mask[rows], position_ids[rows]
            kv = None if kv is None else [(k[rows.to(k.device)], v[rows.to(v.device)]) for k, v in kv]
        cache = kv_batch.to_transformers_cache(kv) if kv is not None else kv_batch.DynamicCache()
        with torch.no_grad():
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=position_ids.to(self.device), use_cache=True,
                             logits_to_keep=num_logits, **{self._cache_kwarg: cache})
        self.num_forward_steps += 1
        self.busy_s += time.perf_counter() - started_s  # model time: idle fraction = 1 - busy / wall
        self.max_batch_size_seen = max(self.max_batch_size_seen, num_rows)
        kv = kv_batch.from_transformers_cache(out[self._cache_kwarg])
        return out.logits[:num_rows].float(), [(k[:num_rows], v[:num_rows]) for k, v in kv]

    def _admit(self) -> None:
        with self._cond:
            free_slots = self.max_running_requests - len(self._running)
            num, max_len = 0, 0
            for r in self._waiting[:free_slots]:
                max_len = max(max_len, len(r.input_ids) + len(r.output_ids))
                if num > 0 and (num + 1) * max_len > MAX_PREFILL_TOKENS:
                    break
                num += 1
        if num > 0:
            self._prefill(self._take_waiting(num))

    def _prefill(self, reqs: list[Request]) -> None:
        # a retracted request re-prefills its prompt plus everything it generated so far
        seqs = [r.input_ids + r.output_ids for r in reqs]
        seq_len = kv_batch.aligned_len(max(map(len, seqs)))  # the cache's invariant (kv_batch.py)
        input_ids = torch.zeros(len(reqs), seq_len, dtype=torch.long)
        mask = torch.zeros(len(reqs), seq_len, dtype=torch.long)
        for i, seq in enumerate(seqs):
            input_ids[i, seq_len - len(seq):] = torch.tensor(seq)
            mask[i, seq_len - len(seq):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        is_all_logits = any(r.is_input_logprob_pending for r in reqs)
        logits, kv = self._forward(input_ids, mask, position_ids, None, 0 if is_all_logits else 1)
        for i, r in enumerate(reqs):
            if r.is_input_logprob_pending:
                r.input_logprobs = self._input_logprobs(r, logits[i, seq_len - len(seqs[i]):])
        keep, sampled = [], []
        for i, r in enumerate(reqs):
            if r.params.max_new_tokens == 0:  # prefill-only scoring
                self._finish(r, {"type": "length", "length": 0})
            else:
                sampled.append(i)
        if sampled:
            tokens, logprobs = sample_tokens(logits[sampled, -1], [reqs[i].params for i in sampled],
                                             [reqs[i].generator for i in sampled])
            for i, token, logprob in zip(sampled, tokens, logprobs):
                if not self._append_token(reqs[i], token, logprob):
                    keep.append(i)
        new = KVBatch(kv, mask, torch.tensor([len(s) for s in seqs])).select(keep)
        self._running = self._running + [reqs[i] for i in keep]
        self._batch = kv_batch.merge(self._batch, new)

    @staticmethod
    def _input_logprobs(r: Request, logits: torch.Tensor) -> list:
        """Input logprob alignment (docs/sglang-contract.md §2.3): entry 0 is [None, ids[L], None];
        entry k is [log p(ids[L+k] | ids[<L+k]), ids[L+k], None]."""
        start, ids = r.logprob_start_len, r.input_ids
        if start >= len(ids):
            return []
        logprobs = torch.log_softmax(logits[start:len(ids) - 1], dim=-1)
        targets = torch.tensor(ids[start + 1:], dtype=torch.long, device=logits.device)
        values = logprobs.gather(1, targets[:, None])[:, 0].clamp(min=torch.finfo(torch.float32).min)
        return [[None, ids[start], None]] + [[lp, t, None] for lp, t in zip(values.tolist(), ids[start + 1:])]

    def _decode(self) -> None:
        batch, reqs = self._batch, self._running
        # the last sampled token of each request is not in the cache yet: feed it now
        input_ids = torch.tensor([[r.output_ids[-1]] for r in reqs])
        mask = torch.cat([batch.mask, torch.ones(len(reqs), 1, dtype=torch.long)], dim=1)
        logits, kv = self._forward(input_ids, mask, batch.num_cached[:, None], batch.kv, 1)
        batch = KVBatch(kv, mask, batch.num_cached + 1)
        tokens, logprobs = sample_tokens(logits[:, -1], [r.params for r in reqs], [r.generator for r in reqs])
        keep = [i for i, (r, t, lp) in enumerate(zip(reqs, tokens, logprobs)) if not self._append_token(r, t, lp)]
        self._running = [reqs[i] for i in keep]
        batch = batch if len(keep) == len(reqs) else batch.select(keep)
        self._batch = batch.realigned() if batch is not None else None

    def _append_token(self, r: Request, token: int, logprob: float) -> bool:
        """Record a sampled token; finish the request if it hit a limit. Returns whether it finished."""
        index = len(r.output_ids)
        r.output_ids.append(token)
        r.output_logprobs.append(logprob)
        if r.version_spans and r.version_spans[-1]["version"] == self.weight_version:
            r.version_spans[-1]["end"] = index + 1
        else:
            r.version_spans.append({"version": self.weight_version, "start": index, "end": index + 1})
        if len(r.output_ids) >= r.params.max_new_tokens:
            self._finish(r, {"type": "length", "length": r.params.max_new_tokens})
        elif not r.params.ignore_eos and (token in self.eos_token_ids or token in r.params.stop_token_ids):
            self._finish(r, {"type": "stop", "matched": token})  # the stop token stays in output_ids
        return r.done.is_set()

    def _finish(self, r: Request, finish_reason: dict) -> None:
        r.finish_reason = finish_reason
        r.weight_version = self.weight_version
        r.e2e_latency_s = time.monotonic() - r.received_s
        r.done.set()
