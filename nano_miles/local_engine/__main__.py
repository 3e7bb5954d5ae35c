"""Local inference engine process: serves a causal LM over SGLang's token-in/token-out HTTP API.
Run: python -m nano_miles.local_engine --model-path DIR [--host 127.0.0.1] [--port 30000] [--device cpu]
(in the pipeline `procs/engine.py` starts it, as it would start `python -m sglang.launch_server`)
"""

import argparse
import ipaddress
import logging
import signal
import threading
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run

log = logging.getLogger("engine")
PROG = "python -m nano_miles.local_engine"
# A row's logits must not depend on what shares its batch, or a seeded request's draws would. With
# `sdpa`, the left padding a batch needs moves a row's logits by ~2e-6, enough to flip a draw now and
# then; `eager` masks padding to exact zeros and gives the same bits alone or batched.
ATTENTION = "eager"


def check_model_dir(path: str) -> str | None:
    """What keeps `path` from being a model directory, or None (`paths.model_dir_problem`; this server
    needs no tokenizer). Checked before transformers loads it."""
    from nano_miles.run.paths import model_dir_problem
    problem = model_dir_problem(Path(path), needs_tokenizer=False)
    return problem and f"--model-path {path}: {problem}"


def device_name(text: str) -> str:
    """--device's value, checked as the config checks it (cpu, cuda or cuda:N)."""
    from nano_miles.run.rules import DEVICE
    if not DEVICE.accepts(text):
        raise argparse.ArgumentTypeError(f"{DEVICE.allowed}, not {text!r}")
    return text


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__)  # a bad flag is a UserError: one line, exit 2
    p.add_argument("--model-path", required=True, help="local Hugging Face causal-LM directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (anything but loopback logs a warning)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", type=device_name, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--weight-version", default="default", help="initial weight_version reported to clients")
    p.add_argument("--random-seed", type=int, default=None,
                   help="seeds the draws of requests without a sampling_seed (as SGLang's flag does); a request "
                        "with one always has its own generator")
    p.add_argument("--max-running-requests", type=int, default=256, help="max requests in the decode batch")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on cpu, where small models gain nothing from more and "
                        "OpenMP threads on shared cores spin against each other; torch's default on cuda)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    if args.max_running_requests < 1:
        raise UserError(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    problem = check_model_dir(args.model_path)
    if problem:
        raise UserError(problem)
    return args


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch  # heavy imports after parsing, so --help is instant
    import transformers

    from nano_miles.local_engine import ENGINE_VERSION
    from nano_miles.local_engine.scheduler import Scheduler
    from nano_miles.local_engine.server import EngineHTTPServer, EngineState
    from nano_miles.observe.metrics import EngineMetrics

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}, but torch sees no CUDA device")
    num_threads = args.num_threads or (1 if args.device == "cpu" else None)
    if num_threads:
        torch.set_num_threads(num_threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    dtype = getattr(torch, args.dtype)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype,
                                                                  attn_implementation=ATTENTION)
    except Exception as e:
        # Whatever fails here is about the user's directory (weights missing or corrupt, a config that
        # transformers rejects): one line names it; --log-level DEBUG shows the traceback.
        log.debug("loading %s failed", args.model_path, exc_info=True)
        raise UserError(f"cannot load {args.model_path}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    model = model.to(args.device).eval()
    config = model.config.get_text_config(decoder=True)
    eos = config.eos_token_id if config.eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    scheduler = Scheduler(model, eos_token_ids, args.weight_version, args.max_running_requests, args.device)
    state = EngineState(scheduler=scheduler, model_path=str(Path(args.model_path)), model_type=model.config.model_type,
                        architectures=list(model.config.architectures or [type(model).__name__]),
                        vocab_size=model.get_input_embeddings().num_embeddings,
                        context_len=getattr(config, "max_position_embeddings", None) or 1 << 20,
                        device=args.device, dtype=args.dtype, host=args.host, port=args.port,
                        metrics=EngineMetrics(scheduler))
    if not is_loopback(args.host):
        log.warning("binding %s: the engine has no authentication; anyone who can reach this port can "
                    "generate and replace the weights", args.host)
    server = EngineHTTPServer(state)
    scheduler.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True).start()
    log.info("%s serving %s (%s, %s, %.1fM params, vocab %d, context %d, eos %s) on http://%s:%d, "
             "weight_version=%s", ENGINE_VERSION, args.model_path, model.config.model_type, args.dtype,
             sum(p.numel() for p in model.parameters()) / 1e6, state.vocab_size, state.context_len,
             sorted(eos_token_ids), args.host, args.port, args.weight_version)
    # wake up now and then so a crashed scheduler also ends the process
    while not stop.wait(timeout=1.0) and scheduler.is_alive:
        pass
    is_crashed = not scheduler.is_alive and not stop.is_set()
    log.info("shutting down" if not is_crashed else "scheduler thread died; exiting")
    server.shutdown()
    scheduler.stop()
    server.server_close()
    return 1 if is_crashed else 0


if __name__ == "__main__":
    run(main, "local_engine")
