"""The tensor transport, trainer side: push named tensors to a running engine without touching disk.

Trainer side; the engine side (rebuild and load) is `tensor_receiver.py`.

Two transports behind SGLang's one endpoint, `/update_weights_from_tensor`:

* CPU (the local engine): tensors are pickled with torch's multiprocessing reductions under the
  `file_system` sharing strategy, so a payload carries only names of shared-memory segments, never the
  data. Pickling a tensor moves its storage into shared memory once; later pushes of the same
  parameters reuse the segment, so an update costs one memory copy on the engine side. The default
  `file_descriptor` strategy cannot work here: the receiver would fetch descriptors from the
  sender's resource sharer, which authenticates with the sender's multiprocessing authkey and so
  rejects an unrelated process.
* GPU with SGLang importable: SGLang's own `FlattenedTensorBucket` + `MultiprocessingSerializer`
  (CUDA IPC handles), in buckets, as its server expects (`load_format="flattened_bucket"`).

"""

from __future__ import annotations

import base64
import io
import pickle
import re
import time
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp

from nano_miles.weights.named_tensors import split_into_buckets, trainable_named_tensors


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, CPU tensor) pairs as shared-memory handles; base64 text for JSON."""
    torch_mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump([(name, t.detach()) for name, t in named_tensors])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def push_weights(client, model: torch.nn.Module, version: int, *,
                 max_bucket_bytes: int = 512 << 20, flush_cache: bool = True) -> dict[str, float]:
    """Send `model`'s weights to the engine behind `client` and tag them `version`.

    The caller pauses generation first. `flush_cache=False` when requests stay in the engine across
    the update (pause modes in_place and retract): SGLang cannot flush its prefix cache while requests
    hold KV, so such engines run without one (--disable-radix-cache). Returns the time split in seconds:
    gather (collect/cast tensors), serialize (build handles) and apply (the engine's answer).
    """
    named = trainable_named_tensors(model)
    if named and named[0][1].is_cuda:
        return _push_cuda_buckets(client, named, version, max_bucket_bytes, flush_cache)
    t0 = time.perf_counter()
    serialized = serialize_named_tensors(named)
    t1 = time.perf_counter()
    # `named` (and with it the shared segments) stays referenced until the engine has answered.
    client.update_weights_from_tensor([serialized], weight_version=version, flush_cache=flush_cache)
    t2 = time.perf_counter()
    return {"gather_s": 0.0, "serialize_s": t1 - t0, "apply_s": t2 - t1, "total_s": t2 - t0}


class TensorSender:
    """The default transport (`engine.weight_transport = "tensor"`): shared memory on CPU, CUDA IPC
    buckets on a GPU; the engine runs on the trainer's host."""

    def __init__(self, engine):
        self.engine = engine

    def push(self, model: torch.nn.Module, version: int, *, flush_cache: bool = True) -> dict[str, float]:
        return push_weights(self.engine, model, version, flush_cache=flush_cache)

    def close(self) -> None:
        """Nothing to release: every push is self-contained."""


def uses_update_sessions(client) -> bool:
    """Whether this SGLang server wants /begin_weight_update ... /end_weight_update around tensor
    updates: newer servers refuse a tensor update outside such a session; 0.5.16 has no such routes
    (404). Asked once per client, from /server_info's version."""
    cached = getattr(client, "is_session_api", None)
    if cached is None:
        version = str(client.server_info().get("version", "0"))
        parts = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
        cached = client.is_session_api = parts >= (0, 5, 23)
    return cached


def _push_cuda_buckets(client, named, version: int, max_bucket_bytes: int,
                       flush_cache: bool = True) -> dict[str, float]:
    """CUDA-IPC path through SGLang's serializer (GPU only; needs `sglang` importable).

    One fresh `FlattenedTensorBucket` per bucket: the server answers once the copies out of it are
    enqueued, so a buffer that was sent is never written again; its handle is dropped only after the
    answer, and torch keeps the memory until the engine has released its mapping."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # device index travels as GPU UUID: engine and trainer may differ
    is_session = uses_update_sessions(client)
    if is_session:
        client.begin_weight_update()
    times = {"gather_s": 0.0, "serialize_s": 0.0, "apply_s": 0.0}
    buckets = list(split_into_buckets(named, max_bucket_bytes))
    for i, bucket in enumerate(buckets):
        t0 = time.perf_counter()
        flat = FlattenedTensorBucket(named_tensors=bucket)
        torch.cuda.synchronize()  # the engine reads the buffer from another process
        t1 = time.perf_counter()
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        serialized = MultiprocessingSerializer.serialize(payload, output_str=True)
        t2 = time.perf_counter()
        is_last = i == len(buckets) - 1
        client.update_weights_from_tensor(
            [serialized], load_format="flattened_bucket", flush_cache=flush_cache and is_last,
            weight_version=version if is_last else None)
        t3 = time.perf_counter()
        del payload, flat
        times["gather_s"] += t1 - t0
        times["serialize_s"] += t2 - t1
        times["apply_s"] += t3 - t2
    if is_session:
        client.end_weight_update()
    torch.cuda.ipc_collect()  # free sent buffers whose engine-side mappings are closed
    times["total_s"] = sum(times.values())
    return times
