"""The project's own small starting policy: a tiny Qwen2 causal LM warmed up on the arithmetic task.
Run: python -m nano_miles.policy build --out DIR [--seed N] [--shape medium --device cuda]
     python -m nano_miles.policy sweep --out DIR --shape medium --device cuda --num-steps N --eval-every K
     python -m nano_miles.policy eval --model DIR

There is no model hub here, so the policy is built from scratch: a byte-level tokenizer with no
merges (one token per ASCII character; `<answer>` and `</answer>` are single tokens), a
Qwen2ForCausalLM with tied embeddings saved as float32 safetensors, and a short supervised warm-up
on the train split that stops early on purpose, so that greedy accuracy starts low while sampling still finds answers:
RL then has both room and a signal. Any local HF causal-LM directory can stand in for this one.

How a prompt becomes input ids (the rollout does this once; ids are never re-tokenized):
    ids = encode_prompt(tokenizer, problem)  # = tokenizer(problem.prompt, add_special_tokens=False)
No BOS and no chat template. The response is `worked step <answer>N</answer>` then the EOS token.
"""

import argparse
import copy
import json
import re
import time
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run
from nano_miles.tasks.arithmetic import (CLOSE_TAG, OPEN_TAG, Problem, extract_answer, make_expressions,
                                         make_problems, num_problems, render_prompt)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"  # UNK is never produced: every byte has a token
ANSWER_TAGS = (OPEN_TAG, CLOSE_TAG)  # one token each; the reward looks for these exact tags
SPECIALS = [PAD, EOS, UNK, *ANSWER_TAGS]
# The same normalizer, pre-tokenizer and decoder as Qwen2Tokenizer, which transformers 5 substitutes
# for whatever tokenizer.json says when config.json is a qwen2 model; so both load paths agree.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def byte_symbols() -> list[str]:
    """The printable stand-in character of each byte 0..255 used by byte-level BPE (GPT-2's table):
    printable Latin-1 bytes stand for themselves, the others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, num_shifted = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + num_shifted)
            num_shifted += 1
    return [symbols[b] for b in range(256)]


# Token id of byte b is len(SPECIALS) + b. decode(encode(s)) == s for any NFC-normalized text.
VOCAB = [*SPECIALS, *byte_symbols()]

MAX_POSITIONS = 256
# "small" is the shipped CPU policy. "medium" (3.2 M parameters, 4x) is the GPU policy: its warm-up
# takes minutes on one GPU, and it can learn the task to high accuracy.
MODEL_SHAPES = {
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS),
    "medium": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS),
}
# Warm-up schedule per shape: (steps, batch size, peak lr). The step counts were picked once from a
# sweep (see assets/policy/README.md and bench/results/gpu/README.md) and are fixed, so a build
# never looks at test accuracy.
WARMUP = {"small": (480, 64, 3e-3), "medium": (450, 256, 1e-3)}
NUM_LR_RAMP_STEPS = 20
MAX_NEW_TOKENS = 40


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The prompt's token ids: plain text, no BOS, no template."""
    return tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]


def build_tokenizer():
    """A byte-level BPE without merges (one token per byte; ASCII text is one token per character)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, EOS, UNK)])
    # Not special: skip_special_tokens=True must keep the tags, the reward reads them.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ANSWER_TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   clean_up_tokenization_spaces=False,
                                   model_max_length=MAX_POSITIONS)


def build_model(seed: int, shape: str = "small"):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(VOCAB), tie_word_embeddings=True, pad_token_id=VOCAB.index(PAD),
                         eos_token_id=VOCAB.index(EOS), bos_token_id=None, **MODEL_SHAPES[shape])
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def make_batch(tokenizer, expressions) -> dict:
    """Right-padded prompt+response+EOS; labels are -100 except on the response and EOS."""
    import torch

    rows, label_rows = [], []
    for e in expressions:
        prompt_ids = encode_prompt(tokenizer, Problem(render_prompt(e.text()), str(e.value())))
        response_ids = tokenizer(e.worked_response(), add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + response_ids + [tokenizer.eos_token_id])
        label_rows.append([-100] * len(prompt_ids) + response_ids + [tokenizer.eos_token_id])
    max_len = max(len(r) for r in rows)
    pad = lambda r, v: r + [v] * (max_len - len(r))  # noqa: E731
    return {
        "input_ids": torch.tensor([pad(r, tokenizer.pad_token_id) for r in rows]),
        "attention_mask": torch.tensor([pad([1] * len(r), 0) for r in rows]),
        "labels": torch.tensor([pad(r, -100) for r in label_rows]),
    }


def lr_at(step: int, peak_lr: float) -> float:
    """Linear ramp, then constant: a run stopped at step k equals the first k steps of a longer one,
    so the stopping step could be chosen from a single long sweep."""
    return peak_lr * min(1.0, (step + 1) / NUM_LR_RAMP_STEPS)


def warm_up(model, tokenizer, *, seed: int, num_steps: int, batch_size: int, peak_lr: float,
            on_step=None) -> None:
    """Supervised warm-up on train problems in a seeded order (cycled if steps outrun the split)."""
    import torch

    expressions = make_expressions("train", num_problems("train"), seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    start_s = time.monotonic()
    for step in range(num_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, peak_lr)
        first = step * batch_size
        batch = make_batch(tokenizer, [expressions[i % len(expressions)] for i in range(first, first + batch_size)])
        loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == num_steps - 1:
            elapsed_s = time.monotonic() - start_s
            eta_s = elapsed_s / (step + 1) * (num_steps - step - 1)
            print(f"warm-up step {step + 1}/{num_steps} loss {loss.item():.4f} "
                  f"elapsed {elapsed_s:.0f}s eta {eta_s:.0f}s", flush=True)
        if on_step is not None:
            on_step(step + 1, model)
    model.eval()


def save_policy(model, tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Name the class transformers would pick for a qwen2 model anyway, so every version loads alike.
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    special = {"eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def warmed_up_model(tokenizer, *, seed: int, shape: str, num_steps: int | None, device: str, on_step=None):
    """The model of `shape` from `seed` after its warm-up (the shape's schedule; `num_steps` if given)."""
    default_steps, batch_size, peak_lr = WARMUP[shape]
    model = build_model(seed, shape).to(device)
    warm_up(model, tokenizer, seed=seed, num_steps=default_steps if num_steps is None else num_steps,
            batch_size=batch_size, peak_lr=peak_lr, on_step=on_step)
    return model


def build_policy(out_dir, *, seed: int = 0, shape: str = "small", num_steps: int | None = None,
                 device: str = "cpu") -> Path:
    """Build the tokenizer and model from `seed`, warm up (the shape's schedule), save to `out_dir`."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    model = warmed_up_model(tokenizer, seed=seed, shape=shape, num_steps=num_steps, device=device)
    save_policy(model.cpu(), tokenizer, out_dir)
    return out_dir


def sweep(out_dir: Path, *, shape: str, num_steps: int, eval_every: int, device: str, seed: int = 0,
          num_eval: int = 200) -> list[dict]:
    """One long warm-up, evaluated every `eval_every` steps; each evaluated snapshot is saved as
    out_dir/step<N>, the table as out_dir/sweep.json. With the constant learning rate after the ramp,
    snapshot N is exactly what `build --num-steps N` makes, so a step count can be picked from here."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, problems, rows = build_tokenizer(), make_problems("test", num_eval), []
    start_s = time.monotonic()

    def on_step(step: int, model) -> None:
        if step % eval_every and step != num_steps:
            return
        model.eval()
        torch.manual_seed(seed)
        row = {"step": step, "warmup_s": round(time.monotonic() - start_s, 1),
               **evaluate_model(model, tokenizer, problems)}
        model.train()
        save_policy(copy.deepcopy(model).cpu(), tokenizer, out_dir / f"step{step}")
        rows.append(row)
        (out_dir / "sweep.json").write_text(json.dumps({"shape": shape, "seed": seed, "rows": rows}, indent=2))
        print("sweep " + " ".join(f"{k} {v}" for k, v in row.items()), flush=True)

    warmed_up_model(tokenizer, seed=seed, shape=shape, num_steps=num_steps, device=device, on_step=on_step)
    return rows


def generate(model, tokenizer, prompts: list[list[int]], *, num_samples: int, temperature: float,
             max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[str]]:
    """Per prompt, `num_samples` decoded responses (greedy when temperature is 0)."""
    import torch

    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    out: list[list[str]] = [[] for _ in prompts]
    # Equal-length groups need no padding, so no position or mask subtleties.
    for indices in by_length.values():
        input_ids = torch.tensor([prompts[i] for i in indices], device=model.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        with torch.no_grad():
            seqs = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=max_new_tokens, num_return_sequences=num_samples,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  **sampling)
        texts = tokenizer.batch_decode(seqs[:, input_ids.shape[1]:], skip_special_tokens=True)
        for k, i in enumerate(indices):
            out[i] = texts[k * num_samples:(k + 1) * num_samples]
    return out


def evaluate_model(model, tokenizer, problems: list[Problem], *, num_samples: int = 8) -> dict[str, float]:
    """Greedy accuracy and format rate, and pass@num_samples at temperature 1."""
    prompts = [encode_prompt(tokenizer, p) for p in problems]
    greedy = [r[0] for r in generate(model, tokenizer, prompts, num_samples=1, temperature=0.0)]
    answers = [extract_answer(r) for r in greedy]
    result = {
        "greedy_accuracy": sum(a == p.answer for a, p in zip(answers, problems)) / len(problems),
        "format": sum(a is not None for a in answers) / len(problems),
    }
    if num_samples > 0:
        samples = generate(model, tokenizer, prompts, num_samples=num_samples, temperature=1.0)
        is_solved = [any(extract_answer(s) == p.answer for s in group) for group, p in zip(samples, problems)]
        result[f"pass@{num_samples}"] = sum(is_solved) / len(problems)
    return result


def load_policy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def evaluate_dir(model_dir, *, num: int = 200, num_samples: int = 8, seed: int = 0) -> dict[str, float]:
    import torch

    torch.manual_seed(seed)
    model, tokenizer = load_policy(model_dir)
    return evaluate_model(model, tokenizer, make_problems("test", num), num_samples=num_samples)


def held_out_count(text: str) -> int:
    """--num / --num-eval: a number of held-out problems, at most what the test split holds."""
    num, limit = int(text) if text.isdigit() else -1, num_problems("test")
    if not 1 <= num <= limit:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {limit}], not {text!r}")
    return num


def device_name(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, not {text!r}")
    return text


def parse_args(argv):
    parser = ArgumentParser(prog="python -m nano_miles.policy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the tokenizer and model from a seed and warm them up")
    build.add_argument("--out", type=Path, required=True, help="output directory (HF format)")
    build.add_argument("--seed", type=int, default=0, help="seed for the weights and the data order")
    build.add_argument("--num-steps", type=int, default=None, help="supervised warm-up steps (default: the shape's)")
    sweep_cmd = sub.add_parser("sweep", help="one long warm-up, evaluated and saved every --eval-every steps")
    sweep_cmd.add_argument("--out", type=Path, required=True, help="directory for step<N>/ snapshots and sweep.json")
    sweep_cmd.add_argument("--num-steps", type=int, required=True, help="supervised warm-up steps")
    sweep_cmd.add_argument("--eval-every", type=int, required=True, help="evaluate and save every N steps")
    sweep_cmd.add_argument("--seed", type=int, default=0, help="seed for the weights and the data order")
    sweep_cmd.add_argument("--num-eval", type=held_out_count, default=200,
                           help="number of test problems per evaluation")
    for cmd in (build, sweep_cmd):
        cmd.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="small",
                         help="model size: small (the shipped CPU policy) or medium (the GPU policy)")
        cmd.add_argument("--device", type=device_name, default="cpu", help="torch device of the warm-up, e.g. cuda")
    evaluate = sub.add_parser("eval", help="greedy accuracy, format rate and pass@k on held-out problems")
    evaluate.add_argument("--model", type=Path, required=True, help="any local HF causal-LM directory")
    evaluate.add_argument("--num", type=held_out_count, default=200, help="number of test problems")
    evaluate.add_argument("--num-samples", type=int, default=8, help="k of pass@k at temperature 1 (0: skip)")
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if getattr(args, "device", "cpu").startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise UserError(f"--device {args.device}, but torch {torch.__version__} sees no CUDA device here")
    if args.command == "eval" and not (args.model / "config.json").is_file():
        raise UserError(f"--model {args.model} is not a local HF model directory (no config.json there)")
    start_s = time.monotonic()
    if args.command == "build":
        build_policy(args.out, seed=args.seed, shape=args.shape, num_steps=args.num_steps, device=args.device)
        print(f"built {args.out} in {time.monotonic() - start_s:.0f}s")
    elif args.command == "sweep":
        sweep(args.out, shape=args.shape, num_steps=args.num_steps, eval_every=args.eval_every,
              device=args.device, seed=args.seed, num_eval=args.num_eval)
    else:
        result = evaluate_dir(args.model, num=args.num, num_samples=args.num_samples, seed=args.seed)
        print(" ".join(f"{k} {v:.3f}" for k, v in result.items()) + f" ({time.monotonic() - start_s:.0f}s)")


if __name__ == "__main__":
    run(main, "policy")
