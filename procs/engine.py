"""Engine slot process: starts one configured engine (the local engine or SGLang) or the router.

Run: python procs/engine.py [--replica K | --router] [--config FILE] [--section.key=value ...] [--print]
(usually by supervisord). The process replaces itself (exec) with the server, so supervisord's signals
reach it. supervisord.conf has a fixed number of engine slots and one router slot; a slot the config
does not use (replica K >= engine.replicas, or the router of a single engine) says so and exits 0,
which supervisord takes as done. `--print` shows the command line instead of running it.
"""

import os

from nano_miles.run.cli import ArgumentParser, run


def main(argv: list[str]) -> int:
    from pathlib import Path

    import nano_miles
    from nano_miles.engine.launch import (engine_command, engine_env, gpu_memory, refuse_a_held_port,
                                         refuse_a_missing_gpu, router_command)
    from nano_miles.run.config import parse_config
    from nano_miles.run.process import die_with_parent

    parser = ArgumentParser(prog="python procs/engine.py", description=__doc__)
    slot = parser.add_mutually_exclusive_group()
    slot.add_argument("--replica", type=int, default=0, metavar="K",
                      help="which engine: it serves on engine.port + K (default 0)")
    slot.add_argument("--router", action="store_true", help="the sglang-router in front of the replicas")
    parser.add_argument("--print", action="store_true", help="print the command line, run nothing")
    cfg, args = parse_config(argv, parser, needs_tokenizer=False)  # token ids in and out
    if args.replica < 0:
        parser.error(f"--replica must be >= 0, not {args.replica}")
    replicas = cfg.engine.replicas
    if (args.router and replicas == 1) or args.replica >= replicas:
        what = "the router" if args.router else f"engine slot {args.replica}"
        print(f"{what} is not used: engine.replicas = {replicas}", flush=True)
        return 0
    env = {} if args.router else {k: os.environ.get(k, v) for k, v in engine_env(cfg).items()}
    if args.print:
        cmd = router_command(cfg) if args.router else engine_command(cfg, args.replica)
        print(" ".join([*(f"{k}={v}" for k, v in env.items()), *cmd]))
        return 0
    port = cfg.engine.router_port if args.router else cfg.engine.port + args.replica
    refuse_a_held_port(cfg.engine.host, port, cfg.run_dir)
    if not args.router:
        refuse_a_missing_gpu(cfg, args.replica)
    # SGLang's share of its GPU counted from what is free as it starts (engine_command's sglang_fraction)
    memory = gpu_memory(cfg.engine_gpu(args.replica)) if cfg.engine.kind == "sglang" and not args.router else None
    cmd = router_command(cfg) if args.router else engine_command(cfg, args.replica, memory)
    os.environ.update(env)
    die_with_parent()  # kept across exec: the server dies with supervisord, never left on its port
    # the server (and SGLang's scheduler processes, which import the flat loader) find this nano_miles
    import_root = str(Path(nano_miles.__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (import_root, os.environ.get("PYTHONPATH", "")) if p)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    run(main, "engine")
