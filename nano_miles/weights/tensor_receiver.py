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


