"""What every pipeline process sets up the same way: logging, the run directory, task, tokenizer, evaluator.

Library module used by the entry points in `procs/`.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys

from nano_miles.config import Config

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to signal this process when its parent (supervisord) dies: no orphans."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def setup_process(name: str, cfg: Config, *, num_threads: int | None = None,
                  is_log_copied: bool = False) -> logging.Logger:
    """Logging to stderr (supervisord files it), run dir, thread count; `is_log_copied` also
    writes the log to <run dir>/<name>.log (for a stage whose stderr goes to the terminal)."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    handlers = [logging.StreamHandler(sys.stderr)]
    if is_log_copied:
        handlers.append(logging.FileHandler(cfg.run_dir / f"{name}.log"))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    die_with_parent()
    if cfg.security.curve_dir:
        from nano_miles.channels import use_curve
        use_curve(cfg.security.curve_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run finally-blocks, close sockets
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no progress bars in stage logs
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # model paths are local directories, never a hub
    import transformers
    transformers.utils.logging.disable_progress_bar()
    if num_threads is not None:
        import torch
        torch.set_num_threads(num_threads)
    return logging.getLogger(name)


def load_task(cfg: Config):
    """The task module named in the config (it provides make_problems(split, num, seed))."""
    return importlib.import_module(cfg.task.name)


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(cfg.model_path()))


def encode_prompts(tokenizer, problems) -> list[list[int]]:
    """Prompt text -> token ids, once; from here on only ids travel (never re-tokenized)."""
    return [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]


def make_decoder(tokenizer):
    """Token ids -> text for the reward function (special tokens such as EOS dropped)."""
    def decode(ids) -> str:
        return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
    return decode


def make_evaluator(cfg: Config, tokenizer, reward_fn):
    """A function engine -> greedy accuracy on the held-out split, in one batched /generate call."""
    task = load_task(cfg)
    problems = task.make_problems("test", cfg.task.num_test, cfg.task.seed)
    prompts = encode_prompts(tokenizer, problems)
    decode = make_decoder(tokenizer)
    params = {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": 0.0}

    def evaluate(engine) -> float:
        outputs = engine.generate(prompts, params, return_logprob=False)
        correct = [reward_fn(decode(out["output_ids"]), p.answer)["accuracy"]
                   for out, p in zip(outputs, problems)]
        return sum(correct) / len(correct)
    return evaluate
