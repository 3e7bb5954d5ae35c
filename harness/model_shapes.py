"""Qwen2.5's model shapes, and random-weight model directories of them for speed and memory figures.

Run: python -m harness.model_shapes --shape 1.5b --out runs/shape-1.5b [--device cuda]

No weights can be downloaded here, so the GPU benches build these: a Qwen2ForCausalLM with the tensor
shapes of Qwen2.5-{0.5,1.5,3,7}B-Instruct (the values of their config.json that set a tensor's shape),
random weights (seed 0, bf16 on disk) and the project's own tokenizer and chat template. Everything that
costs time and memory is real: SGLang's generation over the full vocabulary, the trainer's
forward/backward, weight pushes, checkpoints. A random model never samples a stop id, so every response
runs to max_new_tokens (a fixed-length benchmark); nothing it learns means anything.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

_COMMON = dict(vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
               rms_norm_eps=1e-6, eos_token_id=151645, bos_token_id=151643)
QWEN25_05B = dict(_COMMON, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864)
QWEN25_15B = dict(_COMMON, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960)
QWEN25_3B = dict(_COMMON, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 intermediate_size=11008)
QWEN25_7B = dict(_COMMON, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
SHAPES = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B, "3b": QWEN25_3B, "7b": QWEN25_7B}

# the tokenizer, chat template and generation settings of the project's own policy; its stop ids are
# below 263, which a random model over 152 k ids practically never samples
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
POLICY = Path(__file__).resolve().parent.parent / "nano_miles" / "assets" / "policy"


def num_parameters(shape: dict) -> int:
    """The parameter count of a Qwen2 model of `shape`, without building it (6 N FLOPs per trained token)."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (with bias), k and v (with bias), o
    layer = attention + 3 * h * i + 2 * h                # gate, up, down; two RMSNorms
    embeddings = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    return layers * layer + embeddings + h


def shape_config(name: str):
    from transformers import Qwen2Config
    policy_eos = 1  # the project's tokenizer: <eos>; bos as its tokenizer has it
    return Qwen2Config(**{**SHAPES[name], "eos_token_id": policy_eos, "bos_token_id": None, "pad_token_id": 0})


def build(name: str, out: Path, device: str = "cpu", seed: int = 0) -> Path:
    """Write a random-weight model directory of shape `name` to `out`; returns `out`."""
    import torch
    from transformers import Qwen2ForCausalLM
    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copy(POLICY / f, out / f)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(shape_config(name))
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def built(name: str, out: Path) -> Path:
    """`out`, holding a model directory of shape `name`: built there now unless it already is, on a GPU if
    there is one, by a child process. Built in the caller's own process, the model's memory stayed in
    torch's cache there: a bench that built the 3B shape held 12.8 GiB of the GPU beside the pipeline it
    then started, and the trainer ran out of memory."""
    if not (out / "config.json").exists():
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        subprocess.run([sys.executable, "-m", "harness.model_shapes", "--shape", name, "--out", str(out),
                        "--device", device], check=True, cwd=Path(__file__).resolve().parents[1])
    return out


def main(argv: list[str]) -> int:
    from nano_miles.run.cli import ArgumentParser
    parser = ArgumentParser(prog="python -m harness.model_shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES), help="Qwen2.5's size to copy")
    parser.add_argument("--out", required=True, type=Path, help="the model directory to write")
    parser.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"building {args.shape} ({num_parameters(SHAPES[args.shape]) / 1e9:.2f} B parameters) in {args.out}",
          flush=True)
    build(args.shape, args.out, args.device, args.seed)
    return 0


if __name__ == "__main__":
    from nano_miles.run.cli import run
    run(main, "model_shapes")
