"""Local inference engine: SGLang's token-in/token-out HTTP subset served by transformers + torch.
Run: python procs/engine.py --model-path DIR [--port 30000]

Modules: `sampling` (sampling params and token sampling), `kv_batch` (the batched KV cache),
`scheduler` (the one thread that owns the model and batches requests), `protocol` (request
validation and response shapes), `server` (the HTTP layer).
"""

ENGINE_VERSION = "nano-miles-local-0.1"
