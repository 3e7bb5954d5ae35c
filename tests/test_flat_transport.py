"""The flat path's copy plan, against a stand-in for SGLang's fused Qwen2 parameters (the real server
needs a GPU: tests/test_gpu.py runs it there)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from nano_miles.weights.flat_receiver import build_plan, flat_view


class FusedQwen2(torch.nn.Module):
    """SGLang's parameter naming for Qwen2 at tensor parallelism 1: q/k/v and gate/up fused along
    dim 0, tied lm_head absent, vocabulary rows padded to a multiple of 64."""

    def __init__(self, hf: Qwen2ForCausalLM):
        super().__init__()
        self.config = hf.config
        params = dict(hf.named_parameters())
        self.fused = {}
        for name, p in params.items():
            for a, b, fused in (("q_proj", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                ("gate_proj", ("gate_proj", "up_proj"), "gate_up_proj")):
                if f".{a}." in name:
                    parts = [params[name.replace(a, x)] for x in b]
                    self.fused[name.replace(a, fused)] = torch.zeros(sum(x.shape[0] for x in parts),
                                                                     *p.shape[1:])
            if not any(f".{x}." in name for x in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                rows = -(-p.shape[0] // 64) * 64 if "embed_tokens" in name else p.shape[0]
                self.fused[name] = torch.zeros(rows, *p.shape[1:])
        for i, (name, t) in enumerate(self.fused.items()):
            self.register_parameter(f"p{i}", torch.nn.Parameter(t))
        self.names = list(self.fused)

    def named_parameters(self, *args, **kwargs):
        return [(n, getattr(self, f"p{i}")) for i, n in enumerate(self.names)]


@pytest.fixture
def models():
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=261, tie_word_embeddings=True)
    hf = Qwen2ForCausalLM(cfg)
    return hf, FusedQwen2(hf)


def flat_of(hf, dtype=torch.float32):
    layout, chunks, offset = [], [], 0
    for name, p in hf.named_parameters():
        layout.append([name, offset, list(p.shape), str(dtype).removeprefix("torch.")])
        chunks.append(p.detach().to(dtype).flatten().view(torch.uint8))
        offset += chunks[-1].numel()
    return layout, torch.cat(chunks)


def test_plan_fills_fused_parameters(models):
    hf, fused = models
    layout, flat = flat_of(hf)
    dst, src = build_plan(fused, layout, flat)
    torch._foreach_copy_(dst, src)
    params = dict(fused.named_parameters())
    hf_params = dict(hf.named_parameters())
    q, k, v = (hf_params[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(params["model.layers.1.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    qb, kb, vb = (hf_params[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv")
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.bias"], torch.cat([qb, kb, vb]))
    gate, up = (hf_params[f"model.layers.0.mlp.{x}_proj.weight"] for x in ("gate", "up"))
    assert torch.equal(params["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate, up]))
    embed = params["model.embed_tokens.weight"]
    assert torch.equal(embed[:261], hf_params["model.embed_tokens.weight"]) and embed.shape[0] == 320
    assert torch.equal(flat_view(flat, *layout[0][1:]), hf_params[layout[0][0]])


def test_plan_refuses_a_layout_that_does_not_fit(models):
    hf, fused = models
    layout, flat = flat_of(hf)
    with pytest.raises(ValueError, match="leaves parameters unset"):
        build_plan(fused, [e for e in layout if "norm" not in e[0]], flat)
    bad = [[n, o, [s[0] + 1, *s[1:]] if "o_proj" in n else s, d] for n, o, s, d in layout]
    with pytest.raises(ValueError, match="does not fit"):
        build_plan(fused, bad, flat)


def test_launcher_starts_sglang_with_the_loader_the_sender_names():
    from nano_miles.engine.launch import FLAT_LOADER
    from nano_miles.weights.flat_sender import LOADER

    assert FLAT_LOADER == LOADER  # the launcher spells it as a string so that it imports no torch
