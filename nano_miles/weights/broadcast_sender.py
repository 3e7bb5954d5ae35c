"""Weight updates by collective broadcast: the trainer is rank 0 of a group that every engine joins.
Trainer side, used when `engine.weight_transport = "distributed"`; the group itself is
`broadcast_group.py`, the local engine's side `nano_miles/local_engine/weight_group.py`.
Test: `pytest tests/test_broadcast_transport.py`.

SGLang's NCCL path (docs/sglang-contract.md §3.5), with gloo on CPU:

1. `/init_weights_update_group` blocks inside the rendezvous, so the trainer posts it to every engine
   from threads, joins the group itself as rank 0 (it hosts the TCP store), then waits for the answers.
2. Per bucket, `/update_weights_from_distributed {names, dtypes, shapes}` goes to every engine from
   threads while the trainer broadcasts the same tensors, in the same order, from rank 0. The engines
   allocate empty tensors and receive into them; the last bucket carries `flush_cache` and
   `weight_version`, so the new version becomes visible only once every tensor is in.

The trainer's group is built as SGLang builds the engines' side, over its own `TCPStore`, and is not
the default process group: a trainer run under torchrun (FSDP) keeps its default group for its own
ranks, and the weight group, which spans trainer rank 0 and the engines only, never touches it.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from nano_miles.engine.client import EngineClient, EngineError
from nano_miles.weights.broadcast_group import (WeightTransportError, broadcast_from_rank0, drop_weight_group,
                                                new_weight_group)
from nano_miles.weights.named_tensors import split_into_buckets, trainable_named_tensors

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it): the weight group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BroadcastSender:
    """Trainer side: owns the weight group and pushes a model's tensors to every engine."""

    transport = "distributed"  # as the trainer's summary names the way weights went

    def __init__(self, engines: list[EngineClient], *, backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: int = 0, group_name: str = "weight_update_group", timeout_s: float = 120.0,
                 max_bucket_bytes: int = 512 << 20):
        self.engines = engines
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port  # 0: a free local port per group (single host only)
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.max_bucket_bytes = max_bucket_bytes
        self.group = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="weight-group")

    def _wait_all(self, futures: list) -> list[dict]:
        """Every engine's answer; after all answered, the first failure is raised."""
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result(timeout=self.timeout_s + 5))
            except (EngineError, OSError, TimeoutError) as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return results

    def init_group(self) -> None:
        # an engine that outlived the trainer (killed, restarted) still holds the old group under this
        # name, and a group's name can be registered once: drop it, or the engine refuses to join
        self._drop_engine_groups()
        port = self.master_port
        if port == 0:
            port = free_port()
        world_size = 1 + len(self.engines)  # one rank per engine (tensor parallel size 1)
        futures = [self._pool.submit(e.init_weights_update_group, {
            "master_address": self.master_address, "master_port": port, "rank_offset": 1 + i,
            "world_size": world_size, "group_name": self.group_name, "backend": self.backend,
        }, self.timeout_s) for i, e in enumerate(self.engines)]
        try:
            group = new_weight_group(self.backend, self.master_address, port, 0, world_size,
                                     self.group_name, self.timeout_s)
        except RuntimeError as e:  # rendezvous timed out: some engine never joined
            # an engine that refused to join answered at once, and its answer says why
            refusals = [e for e in (f.exception() for f in futures if f.done()) if e is not None]
            why = f" (an engine answered: {refusals[0]})" if refusals else ""
            raise WeightTransportError(f"weight group rendezvous failed: {e}{why}") from None
        try:
            self._wait_all(futures)
        except (EngineError, OSError, TimeoutError):
            drop_weight_group(group)  # an engine refused: the name is free for the next try
            raise
        self.group = group
        log.info("weight group %s ready: %d engines, %s at %s:%d", self.group_name, len(self.engines),
                 self.backend, self.master_address, port)

    def close(self) -> None:
        """Forget the group (engines that are still up are told to drop theirs)."""
        if self.group is None:
            return
        drop_weight_group(self.group)
        self.group = None
        self._drop_engine_groups()

    def _drop_engine_groups(self) -> None:
        for e in self.engines:
            try:
                e.destroy_weights_update_group(self.group_name, 10.0)
            except (EngineError, OSError) as err:  # a restarted engine has no group: nothing to drop
                log.debug("destroy_weights_update_group on %s: %s", e.base_url, err)

    def push(self, model: torch.nn.Module, version: int, *, flush_cache: bool = True,
             named=None) -> dict[str, float]:
        """Send `model`'s weights tagged `version` to every engine; the caller paused generation.
        `flush_cache` and `named` as in tensor_sender.push_weights."""
        if self.group is None:
            self.init_group()
        named = trainable_named_tensors(model) if named is None else named
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            for bucket, is_last in split_into_buckets(named, self.max_bucket_bytes):
                body = {"names": [n for n, _ in bucket],
                        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                        "shapes": [list(t.shape) for _, t in bucket],
                        "group_name": self.group_name, "flush_cache": flush_cache and is_last,
                        "weight_version": version if is_last else None, "load_format": None}
                futures = [self._pool.submit(e.update_weights_from_distributed, body, self.timeout_s)
                           for e in self.engines]
                broadcast_from_rank0(self.group, [t.contiguous() for _, t in bucket])
                self._wait_all(futures)
                del bucket  # a gathered bucket goes before the next is gathered
        except (WeightTransportError, EngineError, OSError):
            # a half-done update leaves the group out of step: the next update builds a new one, and
            # init_group tells the engines to drop theirs first, so they are not told twice
            drop_weight_group(self.group)
            self.group = None
            raise
        return {"gather_s": 0.0, "serialize_s": 0.0, "apply_s": time.perf_counter() - t0,
                "total_s": time.perf_counter() - t0}
