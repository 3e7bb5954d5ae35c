"""Engine side of the tensor transport: rebuild `/update_weights_from_tensor` payloads and load them.

Used by the local engine (`nano_miles/local_engine/server.py`); the trainer side is `tensor_sender.py`.
The engine never runs arbitrary pickles: `SafeUnpickler` resolves only an exact allow-list of
tensor/storage rebuild functions and plain torch types. CPU payloads carry names of shared-memory
segments (torch's `file_system` sharing strategy), never the data.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle

import torch
import torch.multiprocessing as torch_mp

from nano_miles.weights.named_tensors import WeightUpdateError, copy_into_model

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


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`, through the allow-listed unpickler; WeightUpdateError
    for any payload that does not rebuild into a non-empty list of (name, tensor) pairs."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise WeightUpdateError(f"serialized_named_tensors[0] is not base64: {e}") from None
    torch_mp.set_sharing_strategy("file_system")
    try:
        obj = SafeUnpickler(io.BytesIO(raw)).load()
    except WeightUpdateError:
        raise
    except Exception as e:
        # The bytes are the client's, and so are the arguments the allow-listed torch functions get
        # from them; what those raise on bad arguments is not documented (OverflowError for a size
        # past int64, AssertionError for bad metadata, ...). Whatever it is, the payload is at fault.
        raise WeightUpdateError(f"cannot rebuild tensors: {type(e).__name__}: {e}") from None
    if not isinstance(obj, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor) for item in obj
    ):
        raise WeightUpdateError("payload must be a list of (name: str, tensor) pairs")
    if not obj:
        raise WeightUpdateError("payload holds no tensors")
    return obj


def read_weight_update(serialized_named_tensors: list[str], load_format: str | None = None
                       ) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an `/update_weights_from_tensor` body's fields; WeightUpdateError
    for anything malformed. The engine calls it on the HTTP handler thread, never on the scheduler's."""
    if load_format not in (None, "direct"):
        raise WeightUpdateError(f"load_format {load_format!r} is not supported by this engine "
                                "(use null)")
    if not isinstance(serialized_named_tensors, list) or len(serialized_named_tensors) != 1 \
            or not isinstance(serialized_named_tensors[0], str):
        raise WeightUpdateError("serialized_named_tensors must be a list holding one string "
                                "(this engine has one tensor-parallel rank)")
    return deserialize_named_tensors(serialized_named_tensors[0])


def keep_mapped(named: list[tuple[str, torch.Tensor]]) -> None:
    """Hold an applied update's mapped segments until the next update is applied.

    Dropping the last mapping lets torch's refcount in the segment reach zero and unlink it while the
    trainer still uses it (a later update then fails with "unable to open shared memory object");
    kept, the next update of the same parameters also reuses the mapping instead of faulting every
    page in again."""
    _LIVE_PAYLOAD[:] = named


def apply_weight_update(model: torch.nn.Module, serialized_named_tensors: list[str],
                        load_format: str | None = None) -> int:
    """Rebuild the payload of `/update_weights_from_tensor` and copy it into `model` (all in one
    thread; the engine splits it: `read_weight_update` and `plan_copy` on the HTTP handler thread, then
    `copy_planned` and `keep_mapped` on the scheduler thread)."""
    named = read_weight_update(serialized_named_tensors, load_format)
    num_loaded = copy_into_model(model, named)
    keep_mapped(named)
    return num_loaded
