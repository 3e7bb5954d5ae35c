"""The flat GPU transport, trainer side: one persistent buffer in the engine's dtype, pushed as one tensor.

`FlatSender(engine).push(model, version)`; the engine side, and why this is faster than SGLang's stock
bucket path, is `flat_receiver.py`. GPU only (CUDA IPC), tensor parallelism 1.
"""

from __future__ import annotations

import json
import time

import torch

from nano_miles.engine.client import uses_update_sessions
from nano_miles.weights import flat_receiver
from nano_miles.weights.flat_receiver import ALIGN_BYTES, flat_view
from nano_miles.weights.named_tensors import base_parts, has_adapters, merged_weight, trainable_named_tensors

# what SGLang must have been started with as --custom-weight-loader (nano_miles/engine/launch.py does)
LOADER = f"{flat_receiver.__name__}.{flat_receiver.load_flat.__name__}"


class FlatSender:
    """Owns the flat buffer for the model it pushes (built at the first push); `push` sends its values."""

    def __init__(self, engine, dtype: torch.dtype = torch.bfloat16):
        self.engine, self.dtype = engine, dtype
        self.model: torch.nn.Module | None = None

    def _build(self, model: torch.nn.Module) -> None:
        is_lora = has_adapters(model)  # its merged weights are made one at a time, never kept
        named = [(n, p) for n, p, _ in base_parts(model)] if is_lora else trainable_named_tensors(model)
        layout, offset, device, self.sources = [], 0, None, []
        for name, t in named:
            device = t.device
            offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
            layout.append([name, offset, list(t.shape), str(self.dtype).removeprefix("torch.")])
            offset += t.numel() * self.dtype.itemsize
            if not is_lora:
                self.sources.append(t)
        assert device is not None and device.type == "cuda", "the flat path is for CUDA tensors"
        self.flat = torch.empty(offset, dtype=torch.uint8, device=device)
        self.slots = [flat_view(self.flat, *entry[1:]) for entry in layout]
        self.layout_key = json.dumps(layout, separators=(",", ":"))
        self.num_bytes = offset
        self.model = model

    def push(self, model: torch.nn.Module, version: int, *, flush_cache: bool = True) -> dict[str, float]:
        """Copy, hand the buffer over, wait for the engine; returns the split in seconds."""
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        if model is not self.model:
            self._build(model)
        monkey_patch_torch_reductions()  # the device travels as its UUID (idempotent)
        is_session = uses_update_sessions(self.engine)
        t0 = time.perf_counter()
        with torch.no_grad():
            if has_adapters(model):  # LoRA: each adapted weight merged afresh, straight into its slot
                for slot, (_, p, layer) in zip(self.slots, base_parts(model)):
                    if layer is None:
                        slot.copy_(p.detach())
                    else:
                        merged_weight(layer, out=slot)
            else:
                torch._foreach_copy_(self.slots, self.sources)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        serialized = MultiprocessingSerializer.serialize([(self.layout_key, self.flat)], output_str=True)
        t2 = time.perf_counter()
        if is_session:
            self.engine.begin_weight_update()
        self.engine.update_weights_from_tensor([serialized], load_format=LOADER, flush_cache=flush_cache,
                                               weight_version=version)
        if is_session:
            self.engine.end_weight_update()
        t3 = time.perf_counter()
        return {"gather_s": t1 - t0, "serialize_s": t2 - t1, "apply_s": t3 - t2, "total_s": t3 - t0}

    def close(self) -> None:
        """Nothing to release: the buffer lives as long as the sender."""
