"""HTTP client for the inference engine: SGLang (GPU) or the local engine, same native API.
Used by the rollout producer and the trainer; try `EngineClient("http://127.0.0.1:30000").health()`.

Thread-safe: each thread keeps its own keep-alive connection. Non-2xx answers raise EngineError with the
server's message; `is_permanent` tells a refused generation request (retrying cannot help) from an
engine that is down or busy, and a request refused for its shape (an empty batch) is never sent.
Logprob entries are read by index (e[0] the logprob, e[1] the token id), never unpacked: SGLang sends
[logprob, token_id, text] (the local engine too, text None), and a field it appends later must not
break the client.
"""

import hashlib
import http.client
import json
import logging
import re
import threading
import time
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

RETRYABLE_4XX = (408, 409, 429)  # timeout, conflict, too many requests: worth another try


class EngineError(RuntimeError):
    def __init__(self, status: int, message: str, path: str = ""):
        super().__init__(f"engine answered HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.path = path  # the endpoint that answered so


def is_permanent(e: Exception) -> bool:
    """A /generate refused with a 4xx that will come back every time (a prompt longer than the
    context, a malformed request): the engine is up and the request is at fault, so neither a retry
    nor waiting for the engine can help. A failed weight update answers 4xx too, but is not such a
    refusal: its transport is rebuilt and the update tried again."""
    return (isinstance(e, EngineError) and e.path == "/generate" and 400 <= e.status < 500
            and e.status not in RETRYABLE_4XX)


def _error_message(raw: bytes) -> str:
    """The message from any of the engine's error shapes (SGLang and FastAPI use several)."""
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return text.strip()


def sampling_seed(*identity) -> int:
    """The seed of one generation request: a pure function of what the request is, never of timing.

    The producer names a sample by (run seed, group id, attempt, sample, segment), so two runs with
    one `run.seed` draw the same tokens for the same group on the same weights, whichever requests
    share the engine's batch, while a re-issued group and each resumed segment draw afresh.
    63 bits: SGLang and torch take int64."""
    key = ":".join(str(part) for part in identity).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def parse_output(meta_info: dict, output_ids: list[int]) -> tuple[list[int], list[float], str, str]:
    """(tokens, behaviour logprobs, finish reason type, weight version) of one /generate response."""
    entries = meta_info.get("output_token_logprobs") or []
    # a prefill-only request may carry one spurious entry (docs/sglang-contract.md §2.4)
    entries = entries[:len(output_ids)]
    tokens = [e[1] for e in entries] if entries else list(output_ids)
    if tokens != list(output_ids):
        raise ValueError("output_token_logprobs token ids disagree with output_ids")
    logprobs = [e[0] for e in entries]
    return tokens, logprobs, meta_info["finish_reason"]["type"], meta_info.get("weight_version")


def token_versions(meta_info: dict, num_tokens: int) -> list[int]:
    """The weight version that generated each output token.

    From `weight_versions` spans where the engine reports them (the local engine, SGLang >= 0.5.23);
    otherwise every token gets `weight_version`, which SGLang 0.5.16 reads when the response is
    built (exact for requests that did not live through an update, i.e. with abort-mode pauses).
    Versions must be integers: the pipeline always tags weights with the optimizer step.
    """
    spans = meta_info.get("weight_versions")
    try:
        if not spans:
            return [int(meta_info["weight_version"])] * num_tokens
        versions = []
        for span in spans:
            versions += [int(span["version"])] * (int(span["end"]) - int(span["start"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"engine reported no integer weight version ({e}); start it with "
                         "--weight-version 0") from None
    if len(versions) != num_tokens:
        raise ValueError(f"weight_versions cover {len(versions)} tokens, expected {num_tokens}")
    return versions


def parse_version(value) -> int | None:
    """An engine's `weight_version` text as the pipeline's int; None for anything else (e.g. "default")."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _version_text(version) -> str | None:
    return None if version is None else str(version)


def keeps_requests(pause_mode: str) -> bool:
    """Whether an engine paused in this mode still holds its requests across a weight update (in_place,
    retract). After an abort it holds none: the producer collects the partial samples, and the
    engine's prefix cache can be flushed with the update."""
    return pause_mode != "abort"


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        parts = urlsplit(base_url)
        assert parts.scheme == "http" and parts.hostname, f"expected http://host:port, got {base_url!r}"
        self.base_url = base_url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _request(self, method: str, path: str, body=None, timeout_s: float | None = None) -> tuple[int, bytes]:
        """One HTTP exchange on this thread's keep-alive connection (a new TCP connection per
        call costs milliseconds, more than a small weight update itself)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        timeout_s = timeout_s or self.timeout_s
        conn = getattr(self._local, "conn", None)
        is_reused = conn is not None
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            conn.timeout = timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self._drop_connection()
            if is_reused:  # the server closed an idle connection before reading this request
                return self._request(method, path, body, timeout_s)
            raise
        except http.client.HTTPException as e:
            # the engine died mid-answer (IncompleteRead) or answered garbage: to every caller that is the
            # transport failing, as a refused or reset connection is, and waited out the same way
            self._drop_connection()
            raise ConnectionError(f"{method} {path}: {e!r}") from e
        except OSError:
            self._drop_connection()
            raise

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _call(self, method: str, path: str, body=None, timeout_s: float | None = None):
        status, raw = self._request(method, path, body, timeout_s)
        if not 200 <= status < 300:
            raise EngineError(status, _error_message(raw), path)
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode("utf-8", "replace")

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return self._request("GET", "/health", timeout_s=timeout_s)[0] == 200
        except OSError:  # refused, reset, timed out: not healthy (yet)
            return False

    def wait_until_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        log.info("waiting up to %.0f s for the engine at %s to become healthy", timeout_s, self.base_url)
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine at {self.base_url} not healthy after {timeout_s} s")
            time.sleep(poll_s)

    def generate(self, input_ids, sampling_params, *, return_logprob: bool = True,
                 logprob_start_len: int | None = None, rid=None):
        """One prompt ([int]) -> one response dict; a batch ([[int]]) -> a list in input order.
        An empty prompt or batch is a caller's bug: ValueError, and nothing is sent."""
        prompts = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids]
        if not all(prompts):
            raise ValueError("generate needs at least one prompt, each of at least one token")
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        if rid is not None:
            body["rid"] = rid
        return self._call("POST", "/generate", body)

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """log p(response | prompt) per response token, by a prefill-only request at T = 1
        (docs/sglang-contract.md §2.4)."""
        assert prompt_ids and response_ids, "score needs a non-empty prompt and response"
        out = self.generate(prompt_ids + response_ids, {"max_new_tokens": 0, "temperature": 0.0},
                            logprob_start_len=len(prompt_ids) - 1)
        entries = out["meta_info"]["input_token_logprobs"][-len(response_ids):]
        if [e[1] for e in entries] != list(response_ids):
            raise ValueError(f"input_token_logprobs token ids disagree with the response ids: "
                             f"{[e[1] for e in entries]} for {list(response_ids)} after {len(prompt_ids)} prompt ids")
        return [e[0] for e in entries]

    def pause(self, mode: str = "abort") -> dict:
        """SGLang's /pause_generation in `mode` (wire/control.py PAUSE_MODES; `keeps_requests` says
        what the engine holds through the pause)."""
        return self._call("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> dict:
        return self._call("POST", "/continue_generation", {})

    def flush_cache(self):
        return self._call("GET", "/flush_cache")

    def model_info(self) -> dict:
        return self._call("GET", "/model_info")

    def server_info(self) -> dict:
        return self._call("GET", "/server_info")

    def on_all(self, method: str, *args, **kwargs) -> list:
        """`self.<method>(*args)` as a list of one answer: the interface `EngineGroup.on_all` has."""
        return [getattr(self, method)(*args, **kwargs)]

    def weight_version(self) -> int | None:
        """The weight version served, as the int the pipeline tags weights with (the HTTP API carries
        a string); None when the engine reports something else (e.g. SGLang's "default")."""
        return parse_version(self.model_info().get("weight_version"))

    def begin_weight_update(self) -> dict:
        return self._call("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> dict:
        return self._call("POST", "/end_weight_update", {})

    def _post_update(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        """POST to a weight endpoint, whose answer says `success`: false raises with the server's message."""
        result = self._call("POST", path, body, timeout_s)
        if not (isinstance(result, dict) and result.get("success")):
            raise EngineError(200, f"{path}: " + (result.get("message", "weight update failed")
                                                  if isinstance(result, dict) else repr(result)))
        return result

    # Weight versions are ints in the pipeline and strings in the HTTP API: converted here, both ways.
    def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None) -> dict:
        return self._post_update("/update_weights_from_disk",
                                 {"model_path": model_path, "weight_version": _version_text(weight_version)})

    def update_weights_from_tensor(self, serialized: list[str], *, load_format: str | None = None,
                                   weight_version: int | None = None, flush_cache: bool = True) -> dict:
        return self._post_update("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": _version_text(weight_version)})

    # the weight group of the broadcast transport (nano_miles/weights/broadcast_sender.py)
    def init_weights_update_group(self, body: dict, timeout_s: float | None = None) -> dict:
        return self._post_update("/init_weights_update_group", body, timeout_s)

    def update_weights_from_distributed(self, body: dict, timeout_s: float | None = None) -> dict:
        """`body["weight_version"]` may be an int (or None, for a bucket that is not the last)."""
        body = {**body, "weight_version": _version_text(body.get("weight_version"))}
        return self._post_update("/update_weights_from_distributed", body, timeout_s)

    def destroy_weights_update_group(self, group_name: str, timeout_s: float | None = None) -> dict:
        return self._call("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout_s)


def startup_info(engine) -> dict:
    """The engine's /server_info as first read: its release and start-up arguments, which an engine
    restarted by the same launcher keeps. One request per client (or group), kept on it."""
    info = getattr(engine, "startup_server_info", None)
    if info is None:
        info = engine.startup_server_info = engine.server_info()
    return info


def uses_update_sessions(engine) -> bool:
    """Whether this SGLang server wants /begin_weight_update ... /end_weight_update around tensor
    updates: newer servers refuse a tensor update outside such a session; 0.5.16 has no such routes
    (404). Read from /server_info's version."""
    parts = tuple(int(x) for x in re.findall(r"\d+", str(startup_info(engine).get("version", "0")))[:3])
    return parts >= (0, 5, 23)


def has_prefix_cache(engine) -> bool:
    """Whether the engine keeps KV across requests (SGLang's radix cache), which a weight update must
    flush: a later prompt would otherwise reuse KV computed with the old weights. Without one (SGLang
    with --disable-radix-cache, the local engine) a flush empties nothing, but it still cost 0.4 ms of
    a 5 ms update on an H200 (bench/results/gpu/update_wakeup.json)."""
    return not startup_info(engine).get("disable_radix_cache", False)
