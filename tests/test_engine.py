"""Local engine tests against a real engine process: the SGLang contract, logprob parity, batching, pause.
Run: pytest tests/test_engine.py
"""

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
import torch

from conftest import start_engine, stop_process
from nano_miles.engine.client import EngineClient, EngineError, has_prefix_cache, parse_output

PROMPT = [10, 20, 30, 40, 50, 60]
PROMPTS = [[11 + i, 12 + 2 * i, 40, 41 + i][: 2 + i % 3] + [7] * (i % 5) for i in range(16)]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def client(engine_url) -> EngineClient:
    return EngineClient(engine_url, timeout_s=60)


@pytest.fixture(scope="module")
def hf_model(policy_dir):
    """The trainer's view: the same weights in-process, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def post_raw(url: str, path: str, body: bytes) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def steps(client) -> int:
    return client.server_info()["internal_states"][0]["num_forward_steps"]


def wait_for_progress(client, num_steps: int, timeout_s: float = 20) -> None:
    """Block until the engine ran `num_steps` more forwards (so requests are mid-generation)."""
    start, deadline = steps(client), time.monotonic() + timeout_s
    while steps(client) < start + num_steps:
        assert time.monotonic() < deadline, "engine made no progress"
        time.sleep(0.01)


def test_single_sample_token_in_token_out(client):
    out = client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 1}, rid="one")
    meta = out["meta_info"]
    tokens, logprobs, finish, version = parse_output(meta, out["output_ids"])
    assert meta["id"] == "one" and version == "0" and meta["prompt_tokens"] == len(PROMPT)
    assert 1 <= len(tokens) == meta["completion_tokens"] == meta["output_token_logprobs_length"] <= 8
    assert all(len(e) == 3 and e[2] is None for e in meta["output_token_logprobs"])
    assert all(lp <= 0 for lp in logprobs) and meta["input_token_logprobs"] == []
    assert finish == "length" if len(tokens) == 8 else meta["finish_reason"] == {"type": "stop", "matched": tokens[-1]}
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0


def test_batch_returns_list_in_input_order(client):
    greedy = {"max_new_tokens": 6, "temperature": 0.0}
    batch = client.generate(PROMPTS[:4], greedy, rid="b")
    assert [o["meta_info"]["id"] for o in batch] == ["b_0", "b_1", "b_2", "b_3"]
    for prompt, out in zip(PROMPTS[:4], batch):
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        assert out["output_ids"] == client.generate(prompt, greedy)["output_ids"]
    per_item = client.generate(PROMPTS[:2], [{"max_new_tokens": 1, "ignore_eos": True},
                                             {"max_new_tokens": 3, "ignore_eos": True}])
    assert [len(o["output_ids"]) for o in per_item] == [1, 3]


def test_greedy_is_deterministic(client):
    params = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    a, b = client.generate(PROMPT, params), client.generate(PROMPT, params)
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_prefill_scoring_matches_trainer_forward(client, hf_model):
    prompt, response = PROMPT, [33, 34, 35, 1, 70, 71, 72]
    engine_logprobs = torch.tensor(client.score(prompt, response))
    logits = forward_logits(hf_model, prompt + response)
    trainer = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(response)[:, None])[:, 0]
    assert (engine_logprobs - trainer).abs().mean() <= TOLERANCE
    full = client.generate(prompt + response, {"max_new_tokens": 0}, logprob_start_len=0)
    assert full["output_ids"] == [] and full["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    entries = full["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(prompt + response) and entries[0][0] is None and entries[0][1] == prompt[0]


def test_output_logprobs_are_temperature_scaled_full_vocab(client, hf_model):
    out = client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0.7, "top_k": 5, "top_p": 0.8,
                                   "ignore_eos": True, "sampling_seed": 3})
    tokens, logprobs, _, _ = parse_output(out["meta_info"], out["output_ids"])
    logits = forward_logits(hf_model, PROMPT + tokens)[len(PROMPT) - 1:-1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (torch.tensor(logprobs) - expected).abs().max() <= TOLERANCE


def test_sample_alone_and_in_busy_batch_agree_and_requests_are_batched(client):
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    alone = client.generate(PROMPT, params)
    num_steps_before = steps(client)
    with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        others = [pool.submit(client.generate, p, {**params, "max_new_tokens": 24 + i}) for i, p in enumerate(PROMPTS)]
        prefilled_together = pool.submit(client.generate, PROMPT, params)
        wait_for_progress(client, 3)
        joined_later = pool.submit(client.generate, PROMPT, params)  # merged into the running batch's cache
        busy = [prefilled_together.result(), joined_later.result()]
        assert all(len(f.result()["output_ids"]) == 24 + i for i, f in enumerate(others))
    for out in busy:
        assert out["output_ids"] == alone["output_ids"]
        diff = [abs(a[0] - b[0]) for a, b in zip(alone["meta_info"]["output_token_logprobs"],
                                                 out["meta_info"]["output_token_logprobs"])]
        assert max(diff) <= TOLERANCE
    # one request at a time would take one forward per token: ~16 * 31 + 2 * 24
    assert steps(client) - num_steps_before < 544 / 3
    assert client.server_info()["internal_states"][0]["max_batch_size_seen"] > 1


def test_seeded_sample_is_bit_identical_alone_and_batched(client):
    """A seeded request draws the same tokens with the same logprob bits whatever shares its batch:
    alone, prefilled with others of other lengths, merged into a running batch, or left alone in it."""
    params = {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 12345}
    alone = client.generate(PROMPT, params)
    with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        others = [pool.submit(client.generate, p, {**params, "max_new_tokens": 4 + 3 * i, "sampling_seed": i})
                  for i, p in enumerate(PROMPTS)]  # they finish one by one: the batch shrinks to 1
        prefilled_together = pool.submit(client.generate, PROMPT, params)
        wait_for_progress(client, 3)
        joined_later = pool.submit(client.generate, PROMPT, params)
        busy = [prefilled_together.result(), joined_later.result()]
        assert all(f.result() for f in others)
    for out in busy:
        assert out["output_ids"] == alone["output_ids"]
        assert out["meta_info"]["output_token_logprobs"] == alone["meta_info"]["output_token_logprobs"]
    other_seed = client.generate(PROMPT, {**params, "sampling_seed": 54321})
    assert other_seed["output_ids"] != alone["output_ids"], "the seed must decide the draws"


def test_stop_token_ids_ignore_eos_and_max_new_tokens(client):
    greedy = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    tokens = client.generate(PROMPT, greedy)["output_ids"]
    stop = tokens[5]
    stopped = client.generate(PROMPT, {**greedy, "ignore_eos": False, "stop_token_ids": [stop]})
    first = tokens.index(stop)
    assert stopped["output_ids"] == tokens[:first + 1]  # the stop token is included
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["meta_info"]["completion_tokens"] == first + 1
    ignored = client.generate(PROMPT, {**greedy, "stop_token_ids": [stop]})
    assert ignored["output_ids"] == tokens and ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    one = client.generate(PROMPT, {**greedy, "max_new_tokens": 1})
    assert one["output_ids"] == tokens[:1] and one["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_abort_returns_in_flight_requests_with_partial_output(client):
    params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.generate, p, params) for p in PROMPTS[:4]]
        wait_for_progress(client, 5)
        client.pause("abort")
        # the engine answered every aborted request before pause returned; allow the client threads to read it
        outs = [f.result(timeout=2) for f in futures]
    client.resume()
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < 200
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(client.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True})["output_ids"]) == 2


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_then_continue_completes_requests_unchanged(client, mode):
    params = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    reference = client.generate(PROMPT, params)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.generate, PROMPT, params)
        wait_for_progress(client, 5)
        client.pause(mode)
        sent_while_paused = pool.submit(client.generate, PROMPTS[3], {"max_new_tokens": 3, "ignore_eos": True})
        time.sleep(0.3)
        assert not running.done() and not sent_while_paused.done()  # both wait, neither is rejected
        client.resume()
        out, late = running.result(timeout=30), sent_while_paused.result(timeout=30)
    assert out["output_ids"] == reference["output_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
    diff = [abs(a[0] - b[0]) for a, b in zip(out["meta_info"]["output_token_logprobs"],
                                             reference["meta_info"]["output_token_logprobs"])]
    assert max(diff) <= TOLERANCE
    assert len(late["output_ids"]) == 3


BAD_BODIES = [
    (b"{not json", "JSON"),
    (b"[1, 2]", "object"),
    (b'{"input_ids": []}', "empty"),
    (b'{"sampling_params": {}}', "input_ids"),
    (b'{"input_ids": [1, 100000]}', "vocabulary"),
    (b'{"input_ids": [1, -1]}', "vocabulary"),
    (b'{"input_ids": [1, "2"]}', "integers"),
    (b'{"input_ids": "12"}', "list"),
    (b'{"input_ids": [[1, 2], []]}', "empty"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1.5}}', "integer"),
    (b'{"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}', "temperature"),
    (b'{"input_ids": [1, 2], "sampling_params": {"top_p": 0}}', "top_p"),
    (b'{"input_ids": [1, 2], "sampling_params": {"top_k": 0}}', "top_k"),
    (b'{"input_ids": [1, 2], "sampling_params": {"bogus": 1}}', "bogus"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 100000}}', "context length"),
    (b'{"input_ids": [1, 2], "return_logprob": "yes"}', "return_logprob"),
    (b'{"input_ids": [1, 2], "logprob_start_len": 5}', "logprob_start_len"),
    (b'{"input_ids": [1, 2], "rid": 7}', "rid"),
    (b'{"text": "hello"}', "text"),
    (b'{"input_ids": [1, 2], "stream": true}', "stream"),
]


@pytest.mark.parametrize("body,fragment", BAD_BODIES, ids=[b.decode()[:40] for b, _ in BAD_BODIES])
def test_malformed_generate_gets_400_and_server_keeps_serving(engine_url, client, body, fragment):
    status, reply = post_raw(engine_url, "/generate", body)
    assert status == 400, reply
    assert fragment.lower() in reply["error"]["message"].lower()
    assert client.generate([1, 2], {"max_new_tokens": 1})["meta_info"]["finish_reason"] is not None


def test_control_errors_and_unknown_paths(engine_url, client):
    assert post_raw(engine_url, "/pause_generation", b'{"mode": "sideways"}')[0] == 400
    assert post_raw(engine_url, "/continue_generation", b"{oops")[0] == 400
    assert post_raw(engine_url, "/no_such_route", b"{}")[0] == 404
    status, reply = post_raw(engine_url, "/update_weights_from_tensor",
                             b'{"serialized_named_tensors": ["bm90IGEgcGlja2xl"], "weight_version": "9"}')
    assert status == 400 and reply["success"] is False
    assert client.model_info()["weight_version"] == "0"
    with pytest.raises(EngineError) as e:
        client.pause("sideways")
    assert e.value.status == 400 and "mode" in e.value.message
    assert client.flush_cache().startswith("Cache flushed")
    assert not has_prefix_cache(client)  # nothing to flush: the trainer's updates skip it
    health_generate = lambda: urllib.request.urlopen(engine_url + "/health_generate", timeout=30).status
    assert health_generate() == 200
    client.pause("in_place")
    try:
        with pytest.raises(urllib.error.HTTPError) as e:  # answered at once, not after a timeout
            health_generate()
        assert e.value.code == 503
    finally:
        client.resume()
    assert client.server_info()["version"].startswith("nano-miles-local")


def test_duplicate_in_flight_rid_is_rejected(client):
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.generate, PROMPT, {"max_new_tokens": 150, "ignore_eos": True}, rid="dup")
        wait_for_progress(client, 3)
        with pytest.raises(EngineError) as e:
            client.generate(PROMPT, {"max_new_tokens": 1}, rid="dup")
        assert e.value.status == 400 and "Duplicate" in e.value.message
        assert len(first.result()["output_ids"]) == 150
    assert client.generate(PROMPT, {"max_new_tokens": 1}, rid="dup")["meta_info"]["id"] == "dup"


# ---- a second engine on a random tiny model whose EOS is its own favourite token ----

@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """(url, model dir, eos id): a random 2-layer Qwen2 whose config EOS is its greedy first token."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=63)
    model = Qwen2ForCausalLM(config).float().eval()
    eos = int(forward_logits(model, PROMPT)[-1].argmax())
    model.config.eos_token_id = eos
    model_dir = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(model_dir)
    proc, url = start_engine(model_dir, model_dir.parent / "engine.log")
    yield url, model_dir, eos
    stop_process(proc)


def test_config_eos_stops_generation_unless_ignored(tiny_engine):
    url, _, eos = tiny_engine
    client = EngineClient(url)
    out = client.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0.0})
    assert out["output_ids"] == [eos] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    out = client.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True})
    assert len(out["output_ids"]) == 10 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_weight_update_changes_outputs_and_sets_version(tiny_engine):
    from transformers import AutoModelForCausalLM

    from nano_miles.weights.tensor_sender import serialize_named_tensors

    url, model_dir, _ = tiny_engine
    client = EngineClient(url)
    response = [5, 6, 7, 8]
    before = client.score(PROMPT, response)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reply = client.update_weights_from_tensor([serialize_named_tensors(model.named_parameters())],
                                              weight_version="7")
    assert reply == {"success": True, "message": "Success. Weight version updated to 7."}
    assert client.model_info()["weight_version"] == "7" and client.server_info()["weight_version"] == "7"
    after = client.score(PROMPT, response)
    logits = forward_logits(model, PROMPT + response)
    expected = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1).gather(1, torch.tensor(response)[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3
    assert (torch.tensor(after) - expected).abs().max() <= TOLERANCE
    out = client.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["weight_version"] == "7"
