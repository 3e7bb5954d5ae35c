"""Local inference engine: SGLang's token-in/token-out HTTP subset served by transformers + torch.
Run: python -m nano_miles.local_engine --model-path DIR [--port 30000]

Modules: `sampling` (sampling params and token sampling), `kv_batch` (the batched KV cache),
`scheduler` (the one thread that owns the model and batches requests), `protocol` (request
validation and response shapes), `server` (the HTTP layer).

It behaves like SGLang 0.5.16 launched with --skip-tokenizer-init (docs/sglang-contract.md),
except where SGLang's behaviour would hurt a training loop or needs machinery this engine lacks:

* Bad input is always a 400, never a 500: an unknown `sampling_params` key (SGLang: 500), fields that
  need a tokenizer or streaming (`text`, `stream`, `top_logprobs_num`, ...). SGLang keys we do not
  implement (`min_p`, `n`, penalties, `min_new_tokens`) are accepted only at their neutral value.
* Stricter HTTP framing than uvicorn's: a body needs a Content-Length (chunked or none: 411) and at
  most 64 MiB (413, left unread); a connection silent for 5 s mid-request is closed.
* No prefix cache: `cached_tokens` is 0 and `/flush_cache` always succeeds, even while requests wait.
* Prefill-only requests (`max_new_tokens: 0`) return `output_token_logprobs: []`, without SGLang's
  spurious entry for the dummy token.
* `pause_generation(abort)` finishes running requests at once (SGLang: after one more step).
  `retract` drops the KV cache and re-prefills prompt + generated tokens on resume (tokens and
  logprobs are kept; `num_retractions` counts it); `in_place` keeps the KV cache.
* `update_weights_from_tensor` without a pause is applied at the next step boundary and running
  requests continue on the new weights (SGLang waits until every in-flight request finished). Its
  `flush_cache` flag has nothing to flush. One tensor-parallel rank: only entry 0 is read. Every
  weight update is read and checked on its HTTP handler thread (only the copy waits for the step
  boundary): a payload that does not decode, or whose tensors do not fit the model, is a 400
  `{"success": false}` and leaves model and version as they were.
* `/health_generate` on a paused engine answers 503 at once (SGLang blocks, then 503 after 20 s);
  `/health` does not run a generation.
"""

ENGINE_VERSION = "nano-miles-local-0.1"
