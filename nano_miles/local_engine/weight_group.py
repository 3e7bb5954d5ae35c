"""The local engine's side of distributed weight updates: join the trainer's group, receive broadcasts.
Used by `server.py` for /init_weights_update_group, /update_weights_from_distributed and
/destroy_weights_update_group (docs/sglang-contract.md §3.5); the trainer side is
`nano_miles/weights/broadcast_sender.py`.

Receiving runs on the HTTP handler thread into freshly allocated tensors, so generation is never
blocked by a slow broadcast; only the copy into the model runs on the scheduler thread, between two
forwards, as every other weight update does (SGLang 0.5.23 splits receive and load the same way).
"""

from __future__ import annotations

import logging
import threading

import torch

from nano_miles.weights.broadcast_group import (WeightTransportError, broadcast_from_rank0, drop_weight_group,
                                                new_weight_group, parse_update_meta)

log = logging.getLogger(__name__)


class WeightGroups:
    """The groups this engine has joined, by name (one rank each: no tensor parallelism here)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self._groups: dict[str, object] = {}
        self._lock = threading.Lock()

    def init(self, body: dict) -> None:
        address, port = body.get("master_address"), body.get("master_port")
        rank_offset, world_size = body.get("rank_offset"), body.get("world_size")
        group_name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
        if not isinstance(address, str) or not all(isinstance(v, int) for v in (port, rank_offset, world_size)):
            raise ValueError("master_address (str), master_port, rank_offset and world_size (int) are required")
        if not 0 < rank_offset < world_size:
            raise ValueError(f"rank_offset must be in [1, world_size), got {rank_offset} of {world_size}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA engine; use gloo on CPU")
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"weight group {group_name!r} already exists; destroy it first")
        timeout_s = float(body.get("timeout_s", 120.0))
        try:
            group = new_weight_group(backend, address, port, rank_offset, world_size, group_name, timeout_s)
        except RuntimeError as e:  # rendezvous failed or timed out
            raise ValueError(f"cannot join weight group {group_name!r} at {address}:{port}: {e}") from None
        with self._lock:
            self._groups[group_name] = group
        log.info("joined weight group %s as rank %d of %d (%s)", group_name, rank_offset, world_size, backend)

    def destroy(self, body: dict) -> None:
        group_name = body.get("group_name", "weight_update_group")
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight group named {group_name!r}")
        drop_weight_group(group)
        log.info("left weight group %s", group_name)

    def receive(self, body: dict) -> list[tuple[str, torch.Tensor]]:
        """Receive the tensors named in an /update_weights_from_distributed body, in `names` order."""
        if body.get("load_format") is not None:
            raise ValueError("load_format must be null (per-tensor broadcasts) for this engine")
        meta = parse_update_meta(body)
        group_name = body.get("group_name", "weight_update_group")
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight group named {group_name!r}; call /init_weights_update_group first")
        named = [(name, torch.empty(shape, dtype=dtype, device=self.device)) for name, dtype, shape in meta]
        try:
            broadcast_from_rank0(group, [t for _, t in named])
        except WeightTransportError:
            # The group is out of step now; the trainer builds a new one. A receive can outlive its
            # group, though: a broadcast the trainer gave up on fails here only once the trainer's old
            # sockets close, and by then /destroy_weights_update_group may have dropped this group and
            # a new group of the same name been joined. That one is not this receive's to forget: out
            # of `_groups` but still registered with torch, its name could never be joined again.
            with self._lock:
                is_current = self._groups.get(group_name) is group
                if is_current:
                    del self._groups[group_name]
            if is_current:  # else whoever removed it dropped it
                drop_weight_group(group)
            raise
        return named

