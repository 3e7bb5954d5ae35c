"""supervisord event listener that ends the run: on the trainer's clean exit, or a stage given up on.

Run by supervisord as `[eventlistener:run_end]` (see supervisord.conf); not meant to be run by hand.

When the trainer exits with an expected code, training is done: the listener asks supervisord to
shut down, so `supervisord -c supervisord.conf` returns by itself. When any stage enters FATAL
(it kept dying faster than supervisord's start retries), the run cannot go on: the listener writes
`FAILED` with the reason into the run directory and shuts down too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from supervisor import childutils

from nano_miles.run.cli import ArgumentParser, run


def parse_payload(payload: str) -> dict[str, str]:
    return dict(token.split(":", 1) for token in payload.split() if ":" in token)


def decide(event: str, fields: dict[str, str]) -> str | None:
    """The reason to end the run for this event, or None to keep going."""
    name = fields.get("processname", "")
    if event == "PROCESS_STATE_EXITED" and name == "trainer" and fields.get("expected") == "1":
        return "done"
    if event == "PROCESS_STATE_FATAL":
        return f"failed: {name} could not be kept running"
    return None


def main(argv: list[str]) -> int:
    ArgumentParser(prog="python -m nano_miles.run.run_end", description=__doc__).parse_args(argv)  # --help
    run_dir = Path(os.environ.get("NANOMILES_RUN_DIR", "."))
    while True:
        childutils.listener.ready(sys.stdout)
        line = sys.stdin.readline()
        if not line:
            return 0  # supervisord closed our stdin: it is shutting down
        headers = childutils.get_headers(line)
        payload = sys.stdin.read(int(headers["len"]))
        reason = decide(headers["eventname"], parse_payload(payload))
        if reason is not None:
            if reason != "done":
                (run_dir / "FAILED").write_text(reason + "\n")
            sys.stderr.write(f"run_end: {reason}; shutting supervisord down\n")
            sys.stderr.flush()
            childutils.getRPCInterface(os.environ).supervisor.shutdown()
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    run(main, "run_end")
