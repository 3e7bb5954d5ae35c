"""Weight payloads: shared-memory handles across unrelated processes, and the allow-listed unpickler."""

import base64
import os
import pickle
import subprocess
import sys

import pytest
import torch

from nano_miles.weights.named_tensors import WeightUpdateError, tied_names
from nano_miles.weights.tensor_receiver import apply_weight_update, deserialize_named_tensors
from nano_miles.weights.tensor_sender import serialize_named_tensors

READER = """
import sys, torch
from nano_miles.weights.tensor_receiver import deserialize_named_tensors
named = deserialize_named_tensors(sys.stdin.read())
print(",".join(f"{n}:{t.sum().item():.6f}" for n, t in named))
"""


def test_payload_is_read_by_an_unrelated_process():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.full((5,), 0.5, dtype=torch.bfloat16)
    payload = serialize_named_tensors([("a", a), ("b", b)])
    out = subprocess.run([sys.executable, "-c", READER], input=payload, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    assert out == "a:66.000000,b:2.500000"


def test_payload_carries_handles_not_data():
    big = torch.randn(1 << 20)  # 4 MiB of data
    payload = serialize_named_tensors([("big", big)])
    assert len(payload) < 2000


def test_forbidden_global_is_refused():
    evil = base64.b64encode(pickle.dumps([("x", os.system)])).decode()
    with pytest.raises(WeightUpdateError, match="forbidden global posix.system"):
        deserialize_named_tensors(evil)


@pytest.mark.parametrize("payload, match", [
    ("not base64!!", "not base64"),
    (base64.b64encode(b"\x80\x05garbage").decode(), "cannot rebuild"),
    (base64.b64encode(pickle.dumps({"x": 1})).decode(), "list of"),
    (base64.b64encode(pickle.dumps([("x", 1)])).decode(), "list of"),
])
def test_malformed_payloads_are_refused(payload, match):
    with pytest.raises(WeightUpdateError, match=match):
        deserialize_named_tensors(payload)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_apply_loads_values_and_skips_tied_alias():
    model, source = Tied(), Tied()
    assert tied_names(model) == {"head.weight"}
    n = apply_weight_update(model, [serialize_named_tensors(
        [("embed.weight", source.embed.weight), ("head.weight", torch.zeros(10, 4))])])
    assert n == 1
    assert torch.equal(model.embed.weight, source.embed.weight)
    assert model.head.weight is model.embed.weight


@pytest.mark.parametrize("named, match", [
    ([("nope.weight", torch.zeros(10, 4))], "unknown parameter"),
    ([("embed.weight", torch.zeros(3, 4))], "shape"),
    ([("embed.weight", torch.full((10, 4), float("nan")))], "finite"),
])
def test_bad_update_leaves_model_untouched(named, match):
    model = Tied()
    before = model.embed.weight.detach().clone()
    with pytest.raises(WeightUpdateError, match=match):
        apply_weight_update(model, [serialize_named_tensors(named)])
    assert torch.equal(model.embed.weight, before)


REPEATED_READER = """
import sys, torch
from nano_miles.weights.tensor_receiver import apply_weight_update
model = torch.nn.Linear(4, 3, bias=False)
payload = sys.stdin.readline().strip()
for _ in range(5):  # the same segments, mapped again and again, as with every training step
    apply_weight_update(model, [payload])
print(f"{model.weight.sum().item():.4f}")
"""


def test_segments_survive_repeated_updates_from_another_process():
    weight = torch.full((3, 4), 0.25)
    payload = serialize_named_tensors([("weight", weight)])
    out = subprocess.run([sys.executable, "-c", REPEATED_READER], input=payload + "\n",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "3.0000"
