"""Request parsing: the JSON body of every route; validation and response shapes of `POST /generate`
(docs/sglang-contract.md §2). Used by `server.py`; every ValueError raised here becomes an HTTP 400
in the route's error envelope (`{"error": {"message": ...}}` for /generate).
"""

import json
import uuid

from nano_miles.local_engine.sampling import parse_sampling_params
from nano_miles.local_engine.scheduler import Request

# GenerateReqInput fields that need a tokenizer or features this engine does not have: 400, never ignored.
UNSUPPORTED_FIELDS = {"text": None, "input_embeds": None, "stream": False, "top_logprobs_num": 0,
                      "token_ids_logprob": None, "return_hidden_states": False, "lora_path": None}


def parse_json_body(raw: bytes) -> dict:
    """A request body as a JSON object; an empty body is `{}`."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid JSON body: {e}") from None
    except RecursionError:  # the decoder recurses once per level; real bodies nest three levels deep
        raise ValueError("invalid JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


def _per_item(body: dict, key: str, default, num_items: int, is_batch: bool) -> list:
    """SGLang broadcasts a scalar field over a batch, or takes one value per item."""
    value = body.get(key)
    if value is None:
        return [default] * num_items
    if is_batch and isinstance(value, list):
        if len(value) != num_items:
            raise ValueError(f"{key} has {len(value)} entries for {num_items} inputs")
        return value
    return [value] * num_items


def _check_ids(ids, vocab_size: int, where: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{where} cannot be empty." if isinstance(ids, list) else f"{where} must be a list of ints")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"{where} must contain only integers, got {i!r}")
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id {i} in {where} is outside the vocabulary [0, {vocab_size})")
    return ids


def parse_generate(body, vocab_size: int, context_len: int) -> tuple[list[Request], bool]:
    """Turn a /generate body into Requests; returns (requests, is_batch)."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    for key, neutral in UNSUPPORTED_FIELDS.items():
        if body.get(key, neutral) not in (neutral, None):
            raise ValueError(f"{key!r} is not supported by the local engine (token ids only, no streaming)")
    input_ids = body.get("input_ids")
    if input_ids is None:
        raise ValueError("input_ids is required (the engine serves token ids only)")
    if not isinstance(input_ids, list):
        raise ValueError("input_ids must be a list of token ids (or a list of such lists)")
    if not input_ids:
        raise ValueError("input_ids cannot be empty.")
    is_batch = not isinstance(input_ids[0], int)
    prompts = [_check_ids(p, vocab_size, f"input_ids[{i}]") for i, p in enumerate(input_ids)] if is_batch \
        else [_check_ids(input_ids, vocab_size, "input_ids")]
    num = len(prompts)
    sampling = _per_item(body, "sampling_params", None, num, is_batch)
    return_logprobs = _per_item(body, "return_logprob", False, num, is_batch)
    start_lens = _per_item(body, "logprob_start_len", -1, num, is_batch)
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)] if is_batch else [rid]
    elif is_batch and isinstance(rid, list) and len(rid) == num and all(isinstance(r, str) for r in rid):
        rids = rid
    else:
        raise ValueError("rid must be a string (or one string per input)")
    reqs = []
    for ids, raw_params, return_logprob, start_len, rid in zip(prompts, sampling, return_logprobs, start_lens, rids):
        params = parse_sampling_params(raw_params, vocab_size)
        if not isinstance(return_logprob, bool):
            raise ValueError(f"return_logprob must be a boolean, got {return_logprob!r}")
        if isinstance(start_len, bool) or not isinstance(start_len, int) or start_len < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {start_len!r}")
        if start_len > len(ids):
            raise ValueError(f"logprob_start_len ({start_len}) is greater than the number of input tokens ({len(ids)})")
        if len(ids) + params.max_new_tokens > context_len:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of {context_len} "
                             f"tokens: {len(ids)} input + {params.max_new_tokens} max_new_tokens")
        reqs.append(Request(rid=rid, input_ids=ids, params=params, return_logprob=return_logprob,
                            # SGLang: -1 with return_logprob means "no input logprobs"
                            logprob_start_len=len(ids) if start_len == -1 else start_len))
    return reqs, is_batch


def generate_response(r: Request) -> dict:
    """One response object of docs/sglang-contract.md §2.2 (logprob entries per §2.3)."""
    meta = {"id": r.rid, "finish_reason": r.finish_reason, "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.output_ids), "cached_tokens": 0, "reasoning_tokens": 0,
            "weight_version": r.weight_version, "weight_versions": r.version_spans,
            "num_retractions": r.num_retractions, "e2e_latency": r.e2e_latency_s}
    if r.return_logprob:
        meta["input_token_logprobs"] = r.input_logprobs or []
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.output_logprobs, r.output_ids)]
        meta["output_token_logprobs_length"] = len(r.output_ids)
    return {"output_ids": list(r.output_ids), "meta_info": meta}
