"""Make the CurveZMQ key pairs asyncfp8's channels use.

    python -m asyncfp8.sync.keys --out DIR

Writes the server and client key pairs and DIR/clients/ (docs/sync.md, 'Authentication').
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import zmq.auth

from .security import CLIENT, CLIENTS_DIR, SERVER


def make_keys(out: str | Path, force: bool = False) -> Path:
    out = Path(out)
    if (out / f"{SERVER}.key_secret").exists() and not force:
        raise FileExistsError(
            f"{out} already holds keys; pass force=True (--force) to replace them"
        )
    out.mkdir(parents=True, exist_ok=True)
    for name in (SERVER, CLIENT):
        zmq.auth.create_certificates(str(out), name)
        os.chmod(out / f"{name}.key_secret", 0o600)
    (out / CLIENTS_DIR).mkdir(exist_ok=True)
    shutil.copy2(out / f"{CLIENT}.key", out / CLIENTS_DIR / f"{CLIENT}.key")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncfp8.sync.keys", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="directory for the key files")
    parser.add_argument("--force", action="store_true", help="replace existing keys")
    args = parser.parse_args(argv)
    out = make_keys(args.out, args.force)
    print(
        f"wrote CURVE keys to {out}: {SERVER}.key(_secret), {CLIENT}.key(_secret), "
        f"{CLIENTS_DIR}/{CLIENT}.key"
    )


if __name__ == "__main__":
    main()
