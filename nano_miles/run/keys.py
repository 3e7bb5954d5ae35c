"""ZeroMQ CURVE keys for the pipeline's sockets: one server pair (binders) and one client pair (connectors).

Run: `python -m nano_miles.run.keys DIR`, then set `[security] curve_dir = "DIR"` in the config.

Binding stages encrypt with the server pair and, through a ZAP authenticator, admit only clients whose
public key is in DIR/allowed/; connecting stages use the client pair and the server's public key.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import zmq.auth


def create_keys(key_dir: str | Path) -> None:
    key_dir = Path(key_dir)
    allowed = key_dir / "allowed"
    allowed.mkdir(parents=True, exist_ok=True)
    key_dir.chmod(0o700)
    zmq.auth.create_certificates(key_dir, "server")
    public, _ = zmq.auth.create_certificates(key_dir, "client")
    shutil.copy(public, allowed / "client.key")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__)
        return 2
    create_keys(argv[0])
    print(f"wrote server and client key pairs to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
