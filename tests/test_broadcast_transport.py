"""Distributed weight updates against a real local engine process: gloo group, broadcast, versions."""

import subprocess
import sys
import threading

import pytest
import torch

from conftest import REPO, free_port, start_engine, stop_process
from nano_miles.engine.client import EngineClient, EngineError
from nano_miles.weights.broadcast_sender import BroadcastSender
from nano_miles.weights.named_tensors import tied_names

PROMPT = [3, 4, 5, 6]
RESPONSE = [7, 8, 9, 10]


def trainer_scores(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]


def perturb(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))


@pytest.fixture(scope="module")
def engine(policy_dir, tmp_path_factory):
    proc, url = start_engine(policy_dir, tmp_path_factory.mktemp("engine") / "engine.log")
    yield url
    stop_process(proc)


def test_broadcast_update_matches_trainer_and_sets_version(engine, policy_dir):
    from transformers import AutoModelForCausalLM

    client = EngineClient(engine, timeout_s=60)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    assert tied_names(model) == {"lm_head.weight"}  # the tied head is never sent, as on the tensor path
    before = torch.tensor(client.score(PROMPT, RESPONSE))
    # small buckets: several /update_weights_from_distributed calls per update
    sender = BroadcastSender([client], backend="gloo", timeout_s=30, max_bucket_bytes=64 << 10)
    try:
        for version in (1, 2):  # the second update reuses the group made by the first
            perturb(model, seed=version)
            client.pause("abort")
            sender.push(model, version)
            client.resume()
            after = torch.tensor(client.score(PROMPT, RESPONSE))
            assert (after - trainer_scores(model, PROMPT, RESPONSE)).abs().max() <= 1e-5
            assert client.model_info()["weight_version"] == str(version)
            assert (after - before).abs().max() > 1e-3
            before = after
        out = client.generate(PROMPT, {"max_new_tokens": 2, "ignore_eos": True})
        assert out["meta_info"]["weight_version"] == "2"
    finally:
        sender.close()
    with pytest.raises(EngineError, match="no weight group"):  # the group is gone on the engine too
        client._call("POST", "/destroy_weights_update_group", {"group_name": "weight_update_group"})


def test_a_restarted_trainer_rebuilds_the_group_an_engine_still_holds(engine, policy_dir):
    """A trainer killed with a group up leaves the engine holding that group's name; the next trainer's
    first update must still get through."""
    from transformers import AutoModelForCausalLM

    from nano_miles.weights.broadcast_group import drop_weight_group

    client = EngineClient(engine, timeout_s=60)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    dead = BroadcastSender([client], backend="gloo", timeout_s=30)
    dead.push(model, 11)
    drop_weight_group(dead.group)  # what a killed process leaves: its side gone, the engine's kept
    sender = BroadcastSender([client], backend="gloo", timeout_s=30)
    try:
        perturb(model, seed=12)
        sender.push(model, 12)
        assert client.model_info()["weight_version"] == "12"
        got = torch.tensor(client.score(PROMPT, RESPONSE))
        assert (got - trainer_scores(model, PROMPT, RESPONSE)).abs().max() <= 1e-5
    finally:
        sender.close()


def test_a_trainer_under_torchrun_hosts_the_groups_store(engine, policy_dir, monkeypatch):
    """torchrun tells its ranks to use its agent's store; the weight group's store is the trainer's own."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    client = EngineClient(engine, timeout_s=60)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    sender = BroadcastSender([client], backend="gloo", timeout_s=10)
    try:
        sender.push(model, 13)
        assert client.model_info()["weight_version"] == "13"
    finally:
        sender.close()


def test_an_engine_that_refuses_the_group_is_named_in_the_error(engine):
    """The engine's own reason, not only the rendezvous timeout: a CPU engine refuses an NCCL group."""
    from nano_miles.weights.broadcast_group import WeightTransportError

    sender = BroadcastSender([EngineClient(engine, timeout_s=30)], backend="nccl", timeout_s=2)
    with pytest.raises(WeightTransportError, match="rendezvous failed.*an engine answered.*nccl needs a CUDA engine"):
        sender.init_group()


def test_peers_select_broadcast_transport_by_config(engine, policy_dir):
    """The trainer's own update path (pause -> push -> resume) with engine.weight_transport set."""
    import zmq
    from transformers import AutoModelForCausalLM

    from nano_miles.run.config import load_config
    from nano_miles.stages.trainer.peers import Peers

    port = engine.rsplit(":", 1)[1]
    cfg = load_config(overrides=[f"--engine.port={port}", "--engine.weight_transport=distributed",
                                 "--engine.weight_group_timeout_s=30"])
    link = Peers(cfg, zmq.Context.instance(), durable_state=dict, run_id="test-run")
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    perturb(model, seed=3)
    try:
        link.update_weights(model, 5, tell_producer=False)
        assert link.sender.group is not None and link.version == 5
        client = EngineClient(engine, timeout_s=30)
        assert client.model_info()["weight_version"] == "5"
        got = torch.tensor(client.score(PROMPT, RESPONSE))
        assert (got - trainer_scores(model, PROMPT, RESPONSE)).abs().max() <= 1e-5
        assert client.generate(PROMPT, {"max_new_tokens": 1})["meta_info"]["weight_version"] == "5"  # resumed
    finally:
        link.sender.close()
        link.control.close()


def test_update_without_group_is_refused(engine):
    client = EngineClient(engine, timeout_s=30)
    served = client.model_info()["weight_version"]
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]],
            "group_name": "weight_update_group", "weight_version": "9"}
    with pytest.raises(EngineError, match="init_weights_update_group first"):
        client._call("POST", "/update_weights_from_distributed", body)
    assert client.model_info()["weight_version"] == served


# The trainer's side of a weight group, in its own process (torch registers a group's name once per
# process): for each port read from stdin, it hosts a group there and drops the one before.
RANK0_PEER = """
import sys
from nano_miles.weights.broadcast_group import drop_weight_group, new_weight_group
group = None
for line in sys.stdin:
    if group is not None:
        drop_weight_group(group)
    group = new_weight_group("gloo", "127.0.0.1", int(line), 0, 2, "stale_receive_group", 30.0)
"""


def test_a_receive_that_outlives_its_group_leaves_the_next_one_of_that_name_alone(monkeypatch):
    """A broadcast the trainer gave up on fails on the engine only once the trainer's old sockets close,
    by which time the trainer may have destroyed that group and the engine joined a new one of the same
    name. That failure must not forget the new group: torch would keep its name taken, and the engine
    would refuse every later group of that name ("already been created")."""
    from nano_miles.local_engine import weight_group as engine_side
    from nano_miles.weights.broadcast_group import WeightTransportError

    name = "stale_receive_group"
    in_broadcast, fail_it = threading.Event(), threading.Event()

    def broadcast_failing_late(group, tensors):  # the stale broadcast: it fails when the test says so
        in_broadcast.set()
        fail_it.wait(30)
        raise WeightTransportError("broadcast failed: Connection closed by peer")

    monkeypatch.setattr(engine_side, "broadcast_from_rank0", broadcast_failing_late)
    groups = engine_side.WeightGroups("cpu")
    trainer = subprocess.Popen([sys.executable, "-c", RANK0_PEER], cwd=REPO, stdin=subprocess.PIPE, text=True)

    def join() -> None:
        port = free_port()
        trainer.stdin.write(f"{port}\n")
        trainer.stdin.flush()
        groups.init({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                     "group_name": name, "backend": "gloo", "timeout_s": 15})

    errors = []

    def receive() -> None:
        try:
            groups.receive({"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": name,
                            "load_format": None})
        except Exception as e:  # noqa: BLE001 - which error it is, is what the test checks
            errors.append(e)

    stale = threading.Thread(target=receive)
    try:
        join()
        stale.start()
        assert in_broadcast.wait(10)
        groups.destroy({"group_name": name})  # the trainer's next init_group drops the engine's group,
        join()                                # then builds a new one
        fail_it.set()
        stale.join(10)
        assert [type(e) for e in errors] == [WeightTransportError], errors
        groups.destroy({"group_name": name})  # the new group is still the engine's to drop ...
        join()                                # ... and its name free to join again
        groups.destroy({"group_name": name})
    finally:
        fail_it.set()
        if stale.is_alive():
            stale.join(10)
        trainer.stdin.close()
        try:
            trainer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
