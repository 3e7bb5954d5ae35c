"""Run-end listener process: supervisord's `[eventlistener:run_end]`; ends the run when training is done
or a stage cannot be kept running, and restarts a stage that hangs (`nano_miles/run/watch.py` decides).

Run by supervisord (see supervisord.conf); not meant to be run by hand: it speaks supervisord's
event-listener protocol on stdin/stdout.
"""

from nano_miles.run.cli import ArgumentParser, run


def main(argv: list[str]) -> int:
    ArgumentParser(prog="python procs/run_end.py", description=__doc__).parse_args(argv)  # --help
    import os
    import sys
    import time
    from pathlib import Path

    from supervisor import childutils

    from nano_miles.run.config import load_config
    from nano_miles.run.watch import RunWatch, log, parse_payload

    cfg = load_config()  # the run's config: $NANOMILES_CONFIG and $NANOMILES_OVERRIDES
    rpc = childutils.getRPCInterface(os.environ).supervisor
    watch = RunWatch(Path(os.environ.get("NANOMILES_RUN_DIR", cfg.run_dir)), cfg.run.hang_timeout_s, rpc)
    while True:
        childutils.listener.ready(sys.stdout)
        line = sys.stdin.readline()
        if not line:
            return 0  # supervisord closed our stdin: it is shutting down
        headers = childutils.get_headers(line)
        payload = sys.stdin.read(int(headers["len"]))
        reason = watch.on_event(headers["eventname"], parse_payload(payload), time.time())
        if reason is not None and not watch.is_ending:
            watch.is_ending = True
            if reason.startswith("failed"):  # not for a refusal: the run directory may be a finished run's
                (watch.run_dir / "FAILED").write_text(reason + "\n")
            log(f"{reason}; shutting supervisord down")
            rpc.shutdown()
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    run(main, "run_end")
