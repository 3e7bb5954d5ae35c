"""The tensor transport, trainer side: push named tensors to a running engine without touching disk.

Trainer side; the engine side (rebuild and load) is `tensor_receiver.py`.

Three paths behind SGLang's one endpoint, `/update_weights_from_tensor`; `TensorSender` picks one:

* CPU (the local engine): tensors are pickled with torch's multiprocessing reductions under the
  `file_system` sharing strategy, so a payload carries only names of shared-memory segments, never the
  data. Pickling a tensor moves its storage into shared memory once; later pushes of the same
  parameters reuse the segment, so an update costs one memory copy on the engine side. The default
  "file_descriptor" sharing strategy cannot work here: the receiver would fetch descriptors from the
  sender's resource sharer, which authenticates with the sender's multiprocessing authkey and so
  rejects an unrelated process.
* GPU, engines started with the project's loader: one persistent buffer mapped once (`flat_sender.py`).
* GPU otherwise (SGLang importable): SGLang's own `FlattenedTensorBucket` + `MultiprocessingSerializer`
  (CUDA IPC handles), in buckets, as its server expects (`load_format="flattened_bucket"`).
"""

from __future__ import annotations

import base64
import io
import logging
import pickle
import time
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp

from nano_miles.engine.client import uses_update_sessions
from nano_miles.weights.flat_sender import LOADER as FLAT_LOADER
from nano_miles.weights.flat_sender import FlatSender
from nano_miles.weights.named_tensors import is_sharded, split_into_buckets, trainable_named_tensors

log = logging.getLogger(__name__)


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, CPU tensor) pairs as shared-memory handles; base64 text for JSON."""
    torch_mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump([(name, t.detach()) for name, t in named_tensors])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def push_weights(client, model: torch.nn.Module, version: int, *, max_bucket_bytes: int = 512 << 20,
                 flush_cache: bool = True, named=None) -> dict[str, float]:
    """Send `model`'s weights to the engine behind `client` and tag them `version`.

    The caller pauses generation first. `flush_cache=False` when requests stay in the engine across
    the update (pause modes in_place and retract): SGLang cannot flush its prefix cache while requests
    hold KV, so such engines run without one (--disable-radix-cache). Returns the time split in seconds:
    gather (collect/cast tensors), serialize (build handles) and apply (the engine's answer).
    `named`: the (name, tensor) pairs to send, when not `trainable_named_tensors(model)` (a sharded
    model's, gathered as they are read).
    """
    named = trainable_named_tensors(model) if named is None else named
    if next(model.parameters()).is_cuda:
        return _push_cuda_buckets(client, named, version, max_bucket_bytes, flush_cache)
    t0 = time.perf_counter()
    named = list(named)  # one payload: a sharded model's whole weights on rank 0 (the CPU's small models)
    serialized = serialize_named_tensors(named)
    t1 = time.perf_counter()
    # `named` (and with it the shared segments) stays referenced until the engine has answered.
    client.update_weights_from_tensor([serialized], weight_version=version, flush_cache=flush_cache)
    t2 = time.perf_counter()
    return {"gather_s": 0.0, "serialize_s": t1 - t0, "apply_s": t2 - t1, "total_s": t2 - t0}


def serves_flat_loader(server_infos: list[dict]) -> bool:
    """Do all these engines (their /server_info answers) load weights through the flat buffer?
    SGLang reports its --custom-weight-loader list there; the local engine has none."""
    return bool(server_infos) and all(FLAT_LOADER in (info.get("custom_weight_loader") or [])
                                      for info in server_infos)


class TensorSender:
    """`engine.weight_transport = "tensor"` (the default), for engines on the trainer's host. One place
    picks which of three transports it takes, at the first push and again after `close()` (an engine
    restarted):

    * "shared-memory": the model is on the CPU;
    * "flat": the model is on a GPU and every engine loads the flat buffer (SGLang as
      `nano_miles/engine/launch.py` starts it): `flat_sender.FlatSender`, one persistent buffer;
    * "bucket": the model is on a GPU and an engine lacks that loader (an SGLang started elsewhere), or
      the model is sharded over ranks: SGLang's stock CUDA-IPC buckets.
    """

    def __init__(self, engine, *, engine_dtype: str = "bfloat16"):  # the flat buffer's: the engine's dtype
        self.engine = engine
        self.flat = FlatSender(engine, dtype=getattr(torch, engine_dtype))  # its buffer outlives restarts
        self.transport: str | None = None

    def choose_transport(self, model: torch.nn.Module) -> str:
        if not next(model.parameters()).is_cuda:
            return "shared-memory"
        if is_sharded(model):  # gathered tensor by tensor: the flat buffer would hold a whole copy on rank 0
            return "bucket"
        if serves_flat_loader(self.engine.on_all("server_info")):
            return "flat"
        log.warning("an engine does not load the flat buffer (an SGLang started without --custom-weight-loader "
                    "%s, or the local engine): weights go through CUDA-IPC buckets (slower)", FLAT_LOADER)
        return "bucket"

    def push(self, model: torch.nn.Module, version: int, *, flush_cache: bool = True,
             named=None) -> dict[str, float]:
        """`named` as in `push_weights`: a sharded model's gathered tensors."""
        if self.transport is None:
            self.transport = self.choose_transport(model)
            log.info("weight updates go through the %s transport", self.transport)
        if self.transport == "flat":
            return self.flat.push(model, version, flush_cache=flush_cache)
        return push_weights(self.engine, model, version, flush_cache=flush_cache, named=named)

    def close(self) -> None:
        """Forget the transport: a restarted engine may have been started differently."""
        self.transport = None


def _push_cuda_buckets(client, named, version: int, max_bucket_bytes: int,
                       flush_cache: bool = True) -> dict[str, float]:
    """The bucket transport: CUDA IPC through SGLang's serializer (GPU only; needs `sglang` importable).

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
    t0 = time.perf_counter()
    for bucket, is_last in split_into_buckets(named, max_bucket_bytes):  # a sharded model's: gathered here
        flat = FlattenedTensorBucket(named_tensors=bucket)
        torch.cuda.synchronize()  # the engine reads the buffer from another process
        t1 = time.perf_counter()
        payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        serialized = MultiprocessingSerializer.serialize(payload, output_str=True)
        t2 = time.perf_counter()
        client.update_weights_from_tensor(
            [serialized], load_format="flattened_bucket", flush_cache=flush_cache and is_last,
            weight_version=version if is_last else None)
        t3 = time.perf_counter()
        del payload, flat, bucket  # a gathered bucket goes before the next is gathered
        times["gather_s"] += t1 - t0
        times["serialize_s"] += t2 - t1
        times["apply_s"] += t3 - t2
        t0 = time.perf_counter()
    if is_session:
        client.end_weight_update()
    torch.cuda.ipc_collect()  # free sent buffers whose engine-side mappings are closed
    times["total_s"] = sum(times.values())
    return times
