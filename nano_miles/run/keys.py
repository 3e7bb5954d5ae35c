"""ZeroMQ CURVE keys for the pipeline's sockets: one server pair (binders) and one client pair (connectors).

Run: `python -m nano_miles.run.keys DIR`, then set `[security] curve_dir = "DIR"` in the config.

Binding stages encrypt with the server pair and, through a ZAP authenticator, admit only clients whose
public key is in DIR/allowed/; connecting stages use the client pair and the server's public key.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq.auth

from nano_miles.run.cli import ArgumentParser, UserError, run


def create_keys(key_dir: str | Path) -> None:
    key_dir = Path(key_dir)
    allowed = key_dir / "allowed"
    allowed.mkdir(parents=True, exist_ok=True)
    key_dir.chmod(0o700)
    zmq.auth.create_certificates(key_dir, "server")
    public, _ = zmq.auth.create_certificates(key_dir, "client")
    shutil.copy(public, allowed / "client.key")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m nano_miles.run.keys", description=__doc__)
    parser.add_argument("dir", type=Path, help="directory for the key pairs (created, mode 0700)")
    args = parser.parse_args(argv)
    if args.dir.exists() and not args.dir.is_dir():
        raise UserError(f"{args.dir} exists and is not a directory")
    create_keys(args.dir)
    print(f"wrote server and client key pairs to {args.dir}")
    return 0


if __name__ == "__main__":
    run(main, "keys")
