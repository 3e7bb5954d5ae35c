"""How weights move from the trainer into a running engine: one interface, four transports.

Every sender has `push(model, version, *, flush_cache) -> time split` and `close()`:

    tensor_sender.py     shared-memory handles (CPU), the flat buffer or CUDA-IPC buckets (GPU)
                         engine side: tensor_receiver.py
    flat_sender.py       one persistent GPU buffer that SGLang maps once
                         engine side: flat_receiver.py (SGLang's custom weight loader)
    broadcast_sender.py  a torch.distributed group, engines on any host
                         engine side: nano_miles/local_engine/weight_group.py

The trainer picks its sender in one place (`make_sender` in nano_miles/stages/trainer/peers.py) from
`engine.weight_transport`: "tensor" (engines on the trainer's host) or "distributed". The tensor
sender then picks the transport at the first push after each engine (re)start: "shared-memory" for
a CPU model, "flat" on a GPU when every engine was started with the flat buffer's loader
(`nano_miles/engine/launch.py` starts SGLang so), "bucket" (CUDA-IPC buckets) otherwise. Logs and
the trainer's summary (`weight_transport`) name the one taken: shared-memory, flat, bucket or
distributed.

`named_tensors.py` (which tensors, how they load) and `broadcast_group.py` are shared by both sides;
the engine-side modules never import a sender.
"""
