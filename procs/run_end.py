"""Run-end listener process: supervisord's `[eventlistener:run_end]`; ends the run when training is done
or a stage cannot be kept running, and restarts a stage or engine that hangs (`nano_miles/run/watch.py`
decides).

Run by supervisord (see supervisord.conf); not meant to be run by hand: it speaks supervisord's
event-listener protocol on stdin/stdout.
"""

from nano_miles.run.cli import ArgumentParser, UserError, run

LOG_SETTLE_S = 0.5  # before quoting a log: supervisord writes a program's last output after its exit event


def main(argv: list[str]) -> int:
    ArgumentParser(prog="python procs/run_end.py", description=__doc__).parse_args(argv)  # --help
    import os
    import sys
    import time
    import xmlrpc.client
    from pathlib import Path

    from supervisor import childutils

    from nano_miles.engine.client import EngineClient
    from nano_miles.run.config import load_config
    from nano_miles.run.watch import RunWatch, log, parse_payload

    rpc = childutils.getRPCInterface(os.environ).supervisor
    run_dir = Path(os.environ["NANOMILES_RUN_DIR"])  # supervisord.conf sets it
    try:
        cfg = load_config()  # the run's config: $NANOMILES_CONFIG and $NANOMILES_OVERRIDES
    except UserError:  # the stages meet the same mistake and exit 2: that ends the run
        log(run_dir, "the run's config does not load; the stages will say why (and end the run)")
        watch = RunWatch(run_dir, hang_timeout_s=0, supervisor=rpc)
    else:
        engines = {} if cfg.engine.urls else {  # engines of this run's own slots (supervisord.conf names)
            ("engine" if i == 0 else f"engine_{i}"): url for i, url in enumerate(cfg.engine.engine_urls)}
        watch = RunWatch(run_dir, cfg.run.hang_timeout_s, rpc, engines=engines,
                         is_answering=lambda url: EngineClient(url).health(timeout_s=2.0))
    watch.clear_earlier_failure(time.time())
    while True:
        childutils.listener.ready(sys.stdout)
        line = sys.stdin.readline()
        if not line:
            return 0  # supervisord closed our stdin: it is shutting down
        headers = childutils.get_headers(line)
        payload = sys.stdin.read(int(headers["len"]))
        if headers["eventname"] in ("PROCESS_STATE_EXITED", "PROCESS_STATE_FATAL"):
            time.sleep(LOG_SETTLE_S)
        reason = watch.on_event(headers["eventname"], parse_payload(payload), time.time())
        if reason is not None:  # None once the end is decided: the watch ignores later events
            watch.end(reason)
            try:
                rpc.shutdown()
            except xmlrpc.client.Fault:  # someone else shut it down first (Ctrl-C): it is ending anyway
                pass
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    run(main, "run_end")
