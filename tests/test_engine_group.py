"""Several local engines behind sglang-router: generation spread over both, control calls to each."""

import subprocess
import sys

import pytest
import torch

from conftest import free_port, start_engine, stop_process
from harness.servers import wait_for_http
from nano_miles.engine.client import EngineClient
from nano_miles.engine.group import EngineGroup
from nano_miles.weights.broadcast_sender import BroadcastSender
from nano_miles.weights.tensor_sender import push_weights

PROMPT = [3, 4, 5, 6]
RESPONSE = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def two_engines(policy_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engines")
    procs, urls = [], []
    try:
        for i in range(2):
            proc, url = start_engine(policy_dir, logs / f"engine{i}.log")
            procs.append(proc)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.fixture(scope="module")
def router_url(two_engines, tmp_path_factory):
    """sglang-router (Rust) on CPU, round robin over the two engines; skipped if not installed."""
    pytest.importorskip("sglang_router")
    port = free_port()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                 "--port", str(port), "--policy", "round_robin", "--worker-urls", *two_engines],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url + "/health", timeout_s=60, proc=proc)
        yield url
    finally:
        stop_process(proc)


def forward_steps(url: str) -> int:
    return EngineClient(url).server_info()["internal_states"][0]["num_forward_steps"]


def perturbed_model(policy_dir, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_router_spreads_generation_over_both_engines(two_engines, router_url):
    group = EngineGroup(two_engines, router_url=router_url, timeout_s=60)
    before = [forward_steps(u) for u in two_engines]
    for _ in range(6):
        out = group.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True})
        assert len(out["output_ids"]) == 2
    after = [forward_steps(u) for u in two_engines]
    assert all(a > b for a, b in zip(after, before)), f"forward steps {before} -> {after}"


def test_a_group_goes_to_one_engine_as_one_request(two_engines, router_url):
    """Per-sample maps that differ only in their seeds: one request, so one engine takes the whole
    group; its samples still draw apart. Maps that differ otherwise go one request per sample."""
    group = EngineGroup(two_engines, router_url=router_url, timeout_s=60)
    params = [{"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i} for i in range(8)]
    for _ in range(3):
        before = [forward_steps(u) for u in two_engines]
        outs = group.generate([PROMPT] * 8, params)
        moved = [a - b for a, b in zip([forward_steps(u) for u in two_engines], before)]
        assert sorted(m > 0 for m in moved) == [False, True], f"forward steps moved by {moved}"
        assert [len(o["output_ids"]) for o in outs] == [6] * 8
        assert len({tuple(o["output_ids"]) for o in outs}) > 1, "every sample drew the same tokens"
    budgets = [{**p, "max_new_tokens": 2 + i % 2} for i, p in enumerate(params)]  # resumed samples
    outs = group.generate([PROMPT] * 8, budgets)
    assert [len(o["output_ids"]) for o in outs] == [2 + i % 2 for i in range(8)]


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_weight_update_reaches_every_engine(two_engines, router_url, policy_dir, transport):
    group = EngineGroup(two_engines, router_url=router_url, timeout_s=60)
    version = {"tensor": 11, "distributed": 12}[transport]
    model = perturbed_model(policy_dir, seed=version)
    group.pause("abort")
    if transport == "tensor":
        push_weights(group, model, version)
    else:
        sender = BroadcastSender(group.engines, backend="gloo", timeout_s=30)
        sender.push(model, version)
        sender.close()
    group.resume()
    assert group.model_info()["weight_version"] == str(version)
    scores = [torch.tensor(EngineClient(u).score(PROMPT, RESPONSE)) for u in two_engines]
    assert (scores[0] - scores[1]).abs().max() <= 1e-5
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + RESPONSE])).logits[0]
    expected = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1).gather(1, torch.tensor(RESPONSE)[:, None])[:, 0]
    assert (scores[0] - expected).abs().max() <= 1e-5


def test_control_calls_fan_out_and_wait_for_all(two_engines):
    group = EngineGroup(two_engines, timeout_s=30)
    group.pause("abort")
    assert all(EngineClient(u).server_info()["internal_states"][0]["is_paused"] for u in two_engines)
    group.resume()
    assert not any(EngineClient(u).server_info()["internal_states"][0]["is_paused"] for u in two_engines)
    dead = EngineGroup([*two_engines, f"http://127.0.0.1:{free_port()}"], timeout_s=5)
    with pytest.raises(OSError):  # one engine down: the call fails, after the live ones answered
        dead.pause("abort")
    assert all(EngineClient(u).server_info()["internal_states"][0]["is_paused"] for u in two_engines)
    group.resume()
