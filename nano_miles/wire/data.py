"""Data-plane messages of nano-miles (RolloutGroup, ScoredGroup): fields, msgpack layout, validation.

Test: `pytest tests/test_wire.py`; measure: `python bench/wire.py`. Control messages: control.py;
shared framing and group ids: codec.py.

Layout. One message is one msgpack map with the schema version `v` and a `kind` ("rollout" or
"scored"); a scored message is the rollout map plus the scored fields. Token ids travel as raw
little-endian int32 bytes and logprobs/rewards as little-endian float32 bytes, never as lists; decoded arrays are read-only numpy views over the unpacked bytes (no copy). Nothing is pickled.

Trust boundary. The decoders check everything and raise only `WireError`, whose text starts with the
offending field (`samples[3].logprobs: length 17 != response_tokens length 18`). The encoders run the
same checks, so a bad group fails loudly where it was built, not one hop later.

Forward compatibility. Unknown keys in any map are ignored, so a newer sender may add a field without
breaking older receivers; changing or removing the meaning of a field needs a new `v`.

Versions. v4 (sent now): a sample is a trajectory, with a per-token `loss_mask` (uint8 bytes): 1 on the
model's tokens, 0 on the tokens its environment wrote between turns (a tool's result, the next turn's
header), which carry version -1 and logprob 0. v3 (still decoded, as single-turn samples: every token
the model's): a scored group carries rewards and reward parts, no advantages: the trainer computes
them over its step (`nano_miles/algo/advantages.py`). v2 (still decoded): v3 plus `advantages`, which
a reward stage started before an upgrade may still send while the run goes on; the decoder ignores
that key, as any unknown one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack
import numpy as np

from nano_miles.wire.codec import (MAX_MAP_ITEMS, MAX_MESSAGE_BYTES, MAX_SAMPLES_PER_GROUP, MAX_STR_BYTES,
                                   MAX_TOKENS_PER_SEQUENCE, SCHEMA_VERSION, WireError, _show, check_count,
                                   check_text_id, get, parse_group_id, unpack_message)

FINISH_REASONS = ("stop", "length", "abort")
TOKEN_DTYPE = np.dtype("<i4")
FLOAT_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")
NO_VERSION = -1  # the version of a token the environment wrote: no weights generated it


@dataclass(eq=False)
class Sample:
    """One trajectory after the prompt: the model's tokens and, in a multi-turn rollout, the tokens its
    environment wrote between turns, in the order the engine saw them. Invariants: every array has the
    same length R >= 1, and at least one token is the model's."""

    response_tokens: np.ndarray  # int32 (R,): token ids, >= 0, never re-tokenized
    logprobs: np.ndarray         # float32 (R,): behaviour-policy logprob of each model token (nats), finite;
                                 # 0 on the environment's tokens
    versions: np.ndarray         # int32 (R,): weight version that generated each model token, >= 0, in token
                                 # order: a sample that lived through a weight update spans two, and they
                                 # go down where a trainer restarted from an older checkpoint meanwhile;
                                 # NO_VERSION on the environment's tokens
    finish_reason: str           # one of FINISH_REASONS: how the model's last turn ended
    loss_mask: np.ndarray | None = None  # uint8 (R,): 1 on the model's tokens (trained), 0 on the
                                 # environment's; None: every token is the model's (one turn)

    @property
    def model_mask(self) -> np.ndarray:
        """bool (R,): True on the tokens the model generated (the ones a trainer trains)."""
        if self.loss_mask is None:
            return np.ones(len(self.response_tokens), bool)
        return self.loss_mask.view(bool)

    @property
    def num_model_tokens(self) -> int:
        return len(self.response_tokens) if self.loss_mask is None else int(self.loss_mask.sum())

    @property
    def turns(self) -> list[tuple[int, int, bool]]:
        """The trajectory as runs of one author: (start, end, is the model's) token spans, in order."""
        mask = self.model_mask
        edges = [0, *(np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist(), len(mask)]
        return [(a, b, bool(mask[a])) for a, b in zip(edges[:-1], edges[1:])]

    @property
    def oldest_version(self) -> int:
        """The oldest weight version any model token was generated under (not always the first's)."""
        if self.loss_mask is None:
            return int(self.versions.min())
        return int(self.versions[self.model_mask].min())

    @property
    def newest_version(self) -> int:
        """The newest weight version any model token was generated under (not always the last's)."""
        return int(self.versions.max())  # the environment's NO_VERSION is below every real one

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        return (self.finish_reason == other.finish_reason
                and _same(self.response_tokens, other.response_tokens)
                and _same(self.logprobs, other.logprobs) and _same(self.versions, other.versions)
                and np.array_equal(self.model_mask, other.model_mask))


@dataclass(eq=False)
class RolloutGroup:
    """The G samples drawn for one prompt: the unit of scoring, advantage, staleness and accounting."""

    group_id: str              # "e<epoch>-i<dataset index>", stable across re-issues (make_group_id)
    attempt: int               # >= 0: how many times this group was issued before
    prompt_tokens: np.ndarray  # int32 (P,): P >= 1, ids >= 0
    samples: list[Sample]      # 1 <= G <= MAX_SAMPLES_PER_GROUP
    metadata: dict[str, str | int | float | bool] = field(default_factory=dict)  # task data, e.g. "label"
    timestamps: dict[str, float] = field(default_factory=dict)  # stage name -> unix time (s), finite
    run_id: str = ""           # the run it belongs to (1..MAX_ID_CHARS chars, set by the producer from
                               # the trainer's `restore`): a leftover stage of another run is refused

    @property
    def oldest_version(self) -> int:
        """The oldest weight version any token was generated under (staleness is measured from it)."""
        return min(s.oldest_version for s in self.samples)

    @property
    def newest_version(self) -> int:
        """The newest weight version any token was generated under (a rolled-back one is refused)."""
        return max(s.newest_version for s in self.samples)

    @property
    def num_tokens(self) -> int:
        """Prompt tokens plus all response tokens."""
        return len(self.prompt_tokens) + sum(len(s.response_tokens) for s in self.samples)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutGroup):
            return NotImplemented
        return (self.group_id == other.group_id and self.run_id == other.run_id and self.attempt == other.attempt
                and _same(self.prompt_tokens, other.prompt_tokens) and self.samples == other.samples
                and self.metadata == other.metadata and self.timestamps == other.timestamps)


@dataclass(eq=False)
class ScoredGroup:
    """A rollout group with one reward per sample (all arrays length G); the trainer makes advantages."""

    group: RolloutGroup
    rewards: np.ndarray     # float32 (G,): total reward of each sample, finite
    reward_parts: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32 (G,), finite

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ScoredGroup):
            return NotImplemented
        return (self.group == other.group and _same(self.rewards, other.rewards)
                and self.reward_parts.keys() == other.reward_parts.keys()
                and all(_same(a, other.reward_parts[k]) for k, a in self.reward_parts.items()))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a, b)


# ---------------------------------------------------------------- checks (shared by encode and decode)


def validate_rollout(group: RolloutGroup) -> None:
    """Raise WireError naming the first field of `group` that breaks an invariant."""
    parse_group_id(group.group_id)
    check_text_id(group.run_id, "run_id")
    check_count(group.attempt, "attempt")
    num_prompt = _check_tokens(group.prompt_tokens, "prompt_tokens")
    samples = group.samples
    if not isinstance(samples, list) or not 1 <= len(samples) <= MAX_SAMPLES_PER_GROUP:
        raise WireError(f"samples: expected a list of 1..{MAX_SAMPLES_PER_GROUP} samples, got {_show(samples)}")
    for i, s in enumerate(samples):
        # Fast path without building error strings; the precise checks run only to explain a failure.
        num = len(s.response_tokens) if isinstance(s, Sample) and _is_vector(s.response_tokens, "i") else 0
        if not (0 < num <= MAX_TOKENS_PER_SEQUENCE - num_prompt and _is_vector(s.logprobs, "f", num)
                and _is_vector(s.versions, "i", num) and _is_finish_reason(s.finish_reason)
                and (s.loss_mask is None or _is_vector(s.loss_mask, "u", num, itemsize=1))):
            _explain_sample(s, f"samples[{i}]", num_prompt)
    # Values: a few numpy calls over the whole group instead of a few per sample (per-sample calls
    # cost more than the data at G=8, R=1024). Only when one fails, per-array checks name the culprit.
    tokens = np.concatenate([group.prompt_tokens, *(s.response_tokens for s in samples)])
    if tokens.min() < 0:
        _check_token_ids(group.prompt_tokens, "prompt_tokens")
        for i, s in enumerate(samples):
            _check_token_ids(s.response_tokens, f"samples[{i}].response_tokens")
    if not np.isfinite(np.concatenate([s.logprobs for s in samples])).all():
        for i, s in enumerate(samples):
            _check_finite(s.logprobs, f"samples[{i}].logprobs")
    masks = [s.loss_mask for s in samples if s.loss_mask is not None]
    if masks and not (np.concatenate(masks) == 1).all():  # some sample is a trajectory of several turns
        for i, s in enumerate(samples):
            if s.loss_mask is not None:
                _check_trajectory(s, f"samples[{i}]")
    one_turn = [s for s in samples if s.loss_mask is None or s.loss_mask.all()]
    if one_turn and np.concatenate([s.versions for s in one_turn]).min() < 0:
        for i, s in enumerate(samples):
            if s.loss_mask is None or s.loss_mask.all():
                _check_versions(s.versions, f"samples[{i}].versions")
    _check_map(group.metadata, "metadata", (str, int, float, bool))
    _check_map(group.timestamps, "timestamps", (float, int))


def _explain_sample(s: object, where: str, num_prompt: int) -> None:
    if not isinstance(s, Sample):
        raise WireError(f"{where}: expected a Sample, got {type(s).__name__}")
    num = _check_tokens(s.response_tokens, f"{where}.response_tokens", num_prompt)
    _check_array(s.logprobs, f"{where}.logprobs", "f", num, "response_tokens")
    _check_array(s.versions, f"{where}.versions", "i", num, "response_tokens")
    if s.loss_mask is not None:
        _check_array(s.loss_mask, f"{where}.loss_mask", "u", num, "response_tokens", itemsize=1)
    if not _is_finish_reason(s.finish_reason):
        raise WireError(f"{where}.finish_reason: {_show(s.finish_reason)} not in {FINISH_REASONS}")
    raise AssertionError(f"{where}: the fast check failed but no precise check did")


def validate_scored(scored: ScoredGroup) -> None:
    """Raise WireError naming the first field of `scored` that breaks an invariant."""
    if not isinstance(scored.group, RolloutGroup):
        raise WireError(f"group: expected a RolloutGroup, got {type(scored.group).__name__}")
    validate_rollout(scored.group)
    num_samples = len(scored.group.samples)
    _check_floats(scored.rewards, "rewards", num_samples, "samples")
    _check_map(scored.reward_parts, "reward_parts", ())
    for name, part in scored.reward_parts.items():
        _check_floats(part, f"reward_parts.{name}", num_samples, "samples")


def _is_finish_reason(value: object) -> bool:
    return isinstance(value, str) and value in FINISH_REASONS


def _is_vector(a: object, kind: str, length: int | None = None, itemsize: int = 4) -> bool:
    """Is `a` a 1-D array of `itemsize`-byte items of `kind` ("i", "f" or "u"), of `length` if given?"""
    return (isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind == kind and a.dtype.itemsize == itemsize
            and (length is None or len(a) == length))


def _check_array(a: object, where: str, kind: str, length: int | None, length_of: str = "", itemsize: int = 4) -> None:
    if not _is_vector(a, kind, itemsize=itemsize):
        name = {"i": "int32", "f": "float32", "u": "uint8"}[kind]
        got = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise WireError(f"{where}: expected a 1-D {name} array, got {got}")
    if length is not None and len(a) != length:
        raise WireError(f"{where}: length {len(a)} != {length_of} length {length}")


def _check_tokens(a: object, where: str, num_tokens_before: int = 0) -> int:
    _check_array(a, where, "i", None)
    if not len(a):
        raise WireError(f"{where}: empty (at least 1 token)")
    if num_tokens_before + len(a) > MAX_TOKENS_PER_SEQUENCE:
        raise WireError(f"{where}: sequence of {num_tokens_before + len(a)} tokens > "
                        f"MAX_TOKENS_PER_SEQUENCE {MAX_TOKENS_PER_SEQUENCE}")
    return len(a)


def _check_token_ids(a: np.ndarray, where: str) -> None:
    if a.min() < 0:
        raise WireError(f"{where}: negative token id {a.min()} at position {int(a.argmin())}")


def _check_finite(a: np.ndarray, where: str) -> None:
    if not np.isfinite(a).all():
        j = int(np.flatnonzero(~np.isfinite(a))[0])
        raise WireError(f"{where}: non-finite value {a[j]} at position {j}")


def _check_versions(v: np.ndarray, where: str) -> None:
    if v.min() < 0:
        raise WireError(f"{where}: negative version {v.min()} at position {int(v.argmin())}")


def _check_trajectory(s: Sample, where: str) -> None:
    """A multi-turn sample's mask: 0 or 1 per token, at least one model token; the model's tokens carry
    versions >= 0, the environment's NO_VERSION and logprob 0 (no policy generated them)."""
    mask = s.loss_mask
    if mask.max() > 1:
        j = int(np.argmax(mask > 1))
        raise WireError(f"{where}.loss_mask: value {mask[j]} at position {j} is neither 0 nor 1")
    is_model = mask.view(bool)
    if not is_model.any():
        raise WireError(f"{where}.loss_mask: no token is the model's (a trajectory needs at least one)")
    _check_versions(np.where(is_model, s.versions, 0), f"{where}.versions")
    bad = ~is_model & ((s.versions != NO_VERSION) | (s.logprobs != 0))
    if bad.any():
        j = int(np.argmax(bad))
        raise WireError(f"{where}: token {j} is the environment's (loss_mask 0) but has version {s.versions[j]} "
                        f"and logprob {s.logprobs[j]}; expected {NO_VERSION} and 0")


def _check_floats(a: object, where: str, length: int, length_of: str) -> None:
    _check_array(a, where, "f", length, length_of)
    _check_finite(a, where)


def _check_map(m: object, where: str, value_types: tuple[type, ...]) -> None:
    if not isinstance(m, dict) or len(m) > MAX_MAP_ITEMS:
        raise WireError(f"{where}: expected a map of at most {MAX_MAP_ITEMS} items, got {_show(m)}")
    for key, value in m.items():
        if not isinstance(key, str) or not key:
            raise WireError(f"{where}: key {_show(key)} is not a non-empty string")
        if not value_types:
            continue
        if not isinstance(value, value_types) or (bool not in value_types and isinstance(value, bool)):
            names = "|".join(t.__name__ for t in value_types)
            raise WireError(f"{where}[{key!r}]: expected {names}, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(f"{where}[{key!r}]: non-finite value {value}")
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise WireError(f"{where}[{key!r}]: {value} does not fit in 64 bits")
        if isinstance(value, str) and len(value.encode()) > MAX_STR_BYTES:
            raise WireError(f"{where}[{key!r}]: longer than {MAX_STR_BYTES} bytes")


# ---------------------------------------------------------------- encode


def _bin(a: np.ndarray, dtype: np.dtype) -> memoryview:
    # msgpack packs a memoryview as bin without an intermediate bytes copy.
    return memoryview(np.ascontiguousarray(a, dtype=dtype))


def _rollout_map(g: RolloutGroup, kind: str) -> dict:
    return {
        "v": SCHEMA_VERSION, "kind": kind, "run_id": g.run_id, "group_id": g.group_id, "attempt": g.attempt,
        "prompt_tokens": _bin(g.prompt_tokens, TOKEN_DTYPE),
        "samples": [{"response_tokens": _bin(s.response_tokens, TOKEN_DTYPE),
                     "logprobs": _bin(s.logprobs, FLOAT_DTYPE),
                     "versions": _bin(s.versions, TOKEN_DTYPE),
                     "loss_mask": _bin(s.model_mask, MASK_DTYPE),
                     "finish_reason": s.finish_reason} for s in g.samples],
        "metadata": g.metadata,
        "timestamps": {k: float(t) for k, t in g.timestamps.items()},
    }


def _pack(m: dict) -> bytes:
    data = msgpack.packb(m)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message: {len(data)} bytes > MAX_MESSAGE_BYTES {MAX_MESSAGE_BYTES}")
    return data


def encode_rollout(group: RolloutGroup) -> bytes:
    """Validate `group` and pack it as one `kind="rollout"` message."""
    validate_rollout(group)
    return _pack(_rollout_map(group, "rollout"))


def encode_scored(scored: ScoredGroup) -> bytes:
    """Validate `scored` and pack it as one `kind="scored"` message."""
    validate_scored(scored)
    m = _rollout_map(scored.group, "scored")
    m["rewards"] = _bin(scored.rewards, FLOAT_DTYPE)
    m["reward_parts"] = {k: _bin(a, FLOAT_DTYPE) for k, a in scored.reward_parts.items()}
    return _pack(m)


# ---------------------------------------------------------------- decode


def _array(m: dict, key: str, dtype: np.dtype, prefix: str) -> np.ndarray:
    buf = get(m, key, bytes, prefix)
    if len(buf) % dtype.itemsize:
        raise WireError(f"{prefix}{key}: {len(buf)} bytes is not a multiple of {dtype.itemsize} ({dtype.name})")
    return np.frombuffer(buf, dtype=dtype)  # a read-only view: no copy


def _decode_group(m: dict) -> RolloutGroup:
    raw_samples = get(m, "samples", list, "")
    samples = []
    for i, s in enumerate(raw_samples):
        prefix = f"samples[{i}]."
        if not isinstance(s, dict):
            raise WireError(f"samples[{i}]: expected a map, got {type(s).__name__}")
        # v2 and v3 samples are one turn each: no mask, every token the model's
        mask = _array(s, "loss_mask", MASK_DTYPE, prefix) if m["v"] >= 4 else None
        samples.append(Sample(_array(s, "response_tokens", TOKEN_DTYPE, prefix),
                              _array(s, "logprobs", FLOAT_DTYPE, prefix),
                              _array(s, "versions", TOKEN_DTYPE, prefix),
                              get(s, "finish_reason", str, prefix), mask))
    return RolloutGroup(get(m, "group_id", str, ""), get(m, "attempt", int, ""),
                        _array(m, "prompt_tokens", TOKEN_DTYPE, ""), samples,
                        get(m, "metadata", dict, ""), get(m, "timestamps", dict, ""), get(m, "run_id", str, ""))


def decode_rollout(data: bytes | bytearray | memoryview) -> RolloutGroup:
    """The RolloutGroup in one `kind="rollout"` message; WireError naming the field otherwise."""
    m = unpack_message(data, ("rollout",), max_array_items=MAX_SAMPLES_PER_GROUP)
    group = _decode_group(m)
    validate_rollout(group)
    return group


def decode_scored(data: bytes | bytearray | memoryview) -> ScoredGroup:
    """The ScoredGroup in one `kind="scored"` message; WireError naming the field otherwise."""
    m = unpack_message(data, ("scored",), max_array_items=MAX_SAMPLES_PER_GROUP)
    parts = get(m, "reward_parts", dict, "")
    _check_map(parts, "reward_parts", ())  # keys are strings before they name errors below
    scored = ScoredGroup(_decode_group(m), _array(m, "rewards", FLOAT_DTYPE, ""),
                         {k: _array(parts, k, FLOAT_DTYPE, "reward_parts.") for k in parts})
    validate_scored(scored)
    return scored
