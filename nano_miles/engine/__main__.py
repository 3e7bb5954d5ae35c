"""Engine slot process: starts the configured engine, the local engine or SGLang on a GPU.

Run: python -m nano_miles.engine [--config FILE] [--section.key=value ...] [--print]   (usually by supervisord)
The process replaces itself (exec) with the engine server, so supervisord's signals reach it.
`--print` shows the command line instead of running it.
"""

import os

from nano_miles.run.cli import ArgumentParser, run


def main(argv: list[str]) -> int:
    from nano_miles.engine.launch import engine_command
    from nano_miles.run.config import REPO_ROOT, parse_config

    parser = ArgumentParser(prog="python -m nano_miles.engine", description=__doc__)
    parser.add_argument("--print", action="store_true", help="print the engine's command line, run nothing")
    cfg, args = parse_config(argv, parser)
    cmd = engine_command(cfg)
    if args.print:
        print(" ".join(cmd))
        return 0
    # the server (and SGLang's scheduler processes, which import the flat loader) find this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    run(main, "engine")
