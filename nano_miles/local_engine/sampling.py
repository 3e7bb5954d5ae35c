"""Sampling parameters (SGLang's `sampling_params` subset) and batched next-token sampling.
Used by the scheduler; try it with `python -c "from nano_miles.local_engine.sampling import *"`.

Logprob semantics follow SGLang: the reported logprob of a sampled token is log_softmax(logits / T)
in fp32 over the whole vocabulary, before top-k/top-p truncation; greedy requests (T < 1e-6) report
plain log_softmax(logits).
"""

import math
from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-6  # SGLang rewrites 0 <= T < 1e-6 into greedy decoding

# SGLang keys we do not implement, accepted only at their neutral value so portable client code works.
NEUTRAL_VALUES = {"min_p": 0.0, "n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                  "repetition_penalty": 1.0, "min_new_tokens": 0}
# Text-only SGLang keys: meaningless without a tokenizer, ignored (as SGLang does under --skip-tokenizer-init).
TEXT_ONLY_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # also disables stop_token_ids and the model's EOS ids
    sampling_seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _as_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def _as_float(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"sampling_params.{key} must be a finite number, got {value!r}")
    return float(value)


def parse_sampling_params(raw, vocab_size: int) -> SamplingParams:
    """Validate one `sampling_params` dict; raises ValueError with a client-facing message."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
    params = SamplingParams()
    for key, value in raw.items():
        if value is None:  # SGLang: None means "use the default"
            continue
        if key == "max_new_tokens":
            params.max_new_tokens = _as_int(key, value)
            if params.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {value}")
        elif key == "temperature":
            params.temperature = _as_float(key, value)
            if params.temperature < 0:
                raise ValueError(f"temperature must be >= 0, got {value}")
        elif key == "top_p":
            params.top_p = _as_float(key, value)
            if not 0 < params.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {value}")
        elif key == "top_k":
            params.top_k = _as_int(key, value)
            if params.top_k == 0 or params.top_k < -1:
                raise ValueError(f"top_k must be -1 or >= 1, got {value}")
        elif key == "stop_token_ids":
            if not isinstance(value, list):
                raise ValueError("sampling_params.stop_token_ids must be a list of token ids")
            ids = [_as_int(key, v) for v in value]
            if any(not 0 <= i < vocab_size for i in ids):
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
            params.stop_token_ids = frozenset(ids)
        elif key == "ignore_eos":
            if not isinstance(value, bool):
                raise ValueError("sampling_params.ignore_eos must be a boolean")
            params.ignore_eos = value
        elif key == "sampling_seed":
            params.sampling_seed = _as_int(key, value)
        elif key in NEUTRAL_VALUES:
            if value != NEUTRAL_VALUES[key]:
                raise ValueError(f"sampling_params.{key}={value!r} is not supported by the local engine "
                                 f"(only {NEUTRAL_VALUES[key]!r})")
        elif key in TEXT_ONLY_KEYS:
            continue
        else:
            raise ValueError(f"unknown sampling_params key {key!r}")
    if params.top_k > vocab_size:
        params.top_k = -1
    return params


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private RNG for a seeded request, so its samples do not depend on what else is in the batch."""
    if params.sampling_seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.sampling_seed)


def _sample_row(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token from the temperature-scaled distribution truncated by top-k then top-p."""
    probs = logprobs.exp()
    if params.top_k > 0:
        kth_value = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth_value, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, 0) - sorted_probs
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        sorted_probs = torch.where(mass_before < params.top_p * sorted_probs.sum(), sorted_probs, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """Next token and its logprob for each row of `logits` [batch, vocab] (on the model's device)."""
    logits = logits.float()
    temperatures = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=logits.device)
    # dividing by exactly 1.0 is the identity, so greedy rows get plain log_softmax(logits)
    logprobs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    argmax = logits.argmax(dim=-1).tolist()  # one device sync for all greedy rows
    tokens = [argmax[i] if p.is_greedy else _sample_row(logprobs[i], p, generators[i]) for i, p in enumerate(params)]
    chosen = logprobs[torch.arange(len(tokens), device=logits.device), torch.tensor(tokens, device=logits.device)]
    # like SGLang, never report -inf (it is not valid JSON)
    return tokens, chosen.clamp(min=torch.finfo(torch.float32).min).tolist()
