"""The weight group both sides of the broadcast transport join: a process group outside torch's default one.

Library module shared by the trainer side (`broadcast_sender.py`) and the local engine's side
(`nano_miles/local_engine/weight_group.py`); it imports neither.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# dtype names an update may carry (SGLang sends e.g. "bfloat16"); nothing else is allocated
FLOAT_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}


class WeightTransportError(RuntimeError):
    """The weight group broke (a peer died, a broadcast timed out): it must be created again."""


def new_weight_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                     group_name: str, timeout_s: float):
    """Join (rank 0: host) the TCP store at master_address:master_port and build a process group on it,
    outside torch's default group. Blocks until all `world_size` ranks are in.

    Built step for step as SGLang builds its side (`sglang.srt.utils.init_custom_process_group`, which
    miles mirrors on its trainer side): the store the `tcp://` rendezvous makes, prefixed with the
    group's name, then torch's own group helper, which prefixes the keys again (the group name, then
    the device). A group built on the same store any other way waits on keys SGLang never writes: a
    bare `ProcessGroupGloo(PrefixStore(name, store))` timed out against it on CPU. The store is made
    here rather than by the rendezvous itself, because under torchrun (a sharded trainer) the
    rendezvous sees TORCHELASTIC_USE_AGENT_STORE and makes every rank, rank 0 too, a client of a
    store that nobody hosts. The helper registers the group by name, so it must be
    `drop_weight_group`ed before a group of that name is built again."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True)
    group, _ = c10d._new_process_group_helper(  # [] names no default-group ranks: a group of its own
        world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # its ranks are its own
    return group


def drop_weight_group(group) -> None:
    """Shut a weight group down and free its name (a broken one too: a peer that died leaves nothing
    to wait for)."""
    dist.destroy_process_group(group)


def broadcast_from_rank0(group, tensors: list[torch.Tensor]) -> None:
    """Broadcast each tensor in order from rank 0 (all queued first, then awaited)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    works = [group.broadcast([t], opts) for t in tensors]
    try:
        for work in works:
            work.wait()
    except RuntimeError as e:  # gloo/nccl report a dead peer or a timeout this way
        raise WeightTransportError(f"broadcast failed: {e}") from None


def parse_update_meta(body: dict) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) per tensor of an /update_weights_from_distributed body, checked."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes must have the same length")
    meta = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or dtype not in FLOAT_DTYPES:
            raise ValueError(f"bad entry {name!r}: dtype must be one of {sorted(FLOAT_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"{name}: shape must be a list of non-negative integers")
        meta.append((name, FLOAT_DTYPES[dtype], tuple(shape)))
    return meta
