"""Weight hot-updates: the trainer pushes named tensors to a running engine without touching disk.

Used by the trainer (`push_weights`) and by the local engine (`apply_weight_update`).

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

The engine side never runs arbitrary pickles: `SafeUnpickler` resolves only an exact allow-list of
tensor/storage rebuild functions and plain torch types.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import re
import time
from collections.abc import Iterable

import torch
import torch.multiprocessing as torch_mp
from multiprocessing.reduction import ForkingPickler


class WeightUpdateError(ValueError):
    """A weight payload that cannot be applied; nothing was changed in the model."""


# (module, name) pairs a weight payload may reference; everything else is refused.
_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
}


_LIVE_PAYLOAD: list[tuple[str, torch.Tensor]] = []  # engine side: the last update's mapped tensors


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds tensors backed by shared memory (and torch dtypes)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise WeightUpdateError(f"payload references forbidden global {module}.{name}")


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, CPU tensor) pairs as shared-memory handles; base64 text for JSON."""
    torch_mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump([(name, t.detach()) for name, t in named_tensors])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`, through the allow-listed unpickler."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise WeightUpdateError(f"serialized_named_tensors[0] is not base64: {e}") from None
    torch_mp.set_sharing_strategy("file_system")
    try:
        obj = SafeUnpickler(io.BytesIO(raw)).load()
    except WeightUpdateError:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, RuntimeError, ValueError,
            IndexError, KeyError, OSError) as e:
        raise WeightUpdateError(f"cannot rebuild tensors: {type(e).__name__}: {e}") from None
    if not isinstance(obj, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor) for item in obj
    ):
        raise WeightUpdateError("payload must be a list of (name: str, tensor) pairs")
    return obj


def tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that alias another parameter (e.g. a tied lm_head): never sent or loaded."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        else:
            seen[id(p)] = name
    return aliases


def apply_weight_update(model: torch.nn.Module, serialized_named_tensors: list[str],
                        load_format: str | None = None) -> int:
    """Rebuild the payload of `/update_weights_from_tensor` and copy it into `model`."""
    if load_format not in (None, "direct"):
        raise WeightUpdateError(f"load_format {load_format!r} is not supported by this engine "
                                "(use null)")
    if not isinstance(serialized_named_tensors, list) or len(serialized_named_tensors) != 1 \
            or not isinstance(serialized_named_tensors[0], str):
        raise WeightUpdateError("serialized_named_tensors must be a list holding one string "
                                "(this engine has one tensor-parallel rank)")
    named = deserialize_named_tensors(serialized_named_tensors[0])
    num_loaded = copy_into_model(model, named)
    # Hold the mapped segments until the next update. Dropping the last mapping lets torch's
    # refcount in the segment reach zero and unlink it while the trainer still uses it (a later
    # update then fails with "unable to open shared memory object"); kept, the next update of the
    # same parameters also reuses the mapping instead of faulting every page in again.
    _LIVE_PAYLOAD[:] = named
    return num_loaded


def load_weights_from_disk(model: torch.nn.Module, model_path: str) -> int:
    """The `/update_weights_from_disk` path: every *.safetensors file of an HF directory."""
    from pathlib import Path

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {model_path}")
    named = []
    try:
        for f in files:
            named += list(load_file(str(f)).items())
    except (SafetensorError, OSError) as e:
        raise WeightUpdateError(f"cannot read {model_path}: {e}") from None
    return copy_into_model(model, named)


def copy_into_model(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> int:
    """Copy (name, tensor) pairs into `model`'s parameters; returns how many were loaded.

    Every name, shape and value is checked before the first copy, so a bad update leaves the model
    untouched. A tied alias (lm_head.weight when embeddings are tied) is skipped, as SGLang does.
    """
    params = dict(model.named_parameters())
    skip = tied_names(model)
    plan = []
    for name, t in named:
        if name in skip:
            continue
        if name not in params:
            raise WeightUpdateError(f"unknown parameter {name!r}")
        if tuple(t.shape) != tuple(params[name].shape):
            raise WeightUpdateError(f"{name}: shape {tuple(t.shape)} != {tuple(params[name].shape)}")
        # One reduction instead of an elementwise mask (10x cheaper): NaN or inf anywhere makes
        # the sum non-finite; finite weights never come near float overflow.
        if not t.is_floating_point() or not torch.isfinite(t.sum()):
            raise WeightUpdateError(f"{name}: values must be finite floats")
        plan.append((params[name], t))
    with torch.no_grad():
        for param, t in plan:
            param.copy_(t)
    return len(plan)


def trainable_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors an update sends: each parameter once, tied aliases left out."""
    return [(name, p.detach()) for name, p in model.named_parameters()]


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
    client.update_weights_from_tensor([serialized], weight_version=str(version), flush_cache=flush_cache)
    t2 = time.perf_counter()
    return {"gather_s": 0.0, "serialize_s": t1 - t0, "apply_s": t2 - t1, "total_s": t2 - t0}


def _buckets(named: list[tuple[str, torch.Tensor]], max_bucket_bytes: int):
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


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
    buckets = list(_buckets(named, max_bucket_bytes))
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
            weight_version=str(version) if is_last else None)
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
