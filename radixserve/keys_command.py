"""``radixserve keys``: write CURVE certificates for the public socket, and say
where each one goes (``radixserve.curve`` writes them; docs/security.md).
"""

from __future__ import annotations

import argparse
import sys


def add_keys_arguments(k: argparse.ArgumentParser) -> None:
    """The flags of ``radixserve keys`` on ``k``."""
    k.add_argument("dir", metavar="DIR", help="where to write (created with mode 0700)")
    k.add_argument(
        "--client",
        action="append",
        dest="clients",
        metavar="NAME",
        help="a client certificate to write (repeatable; default: 'client')",
    )
    k.add_argument(
        "--server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the server's certificate unless DIR has one",
    )


def keys_main(args: argparse.Namespace) -> int:
    """``radixserve keys``: write the certificates, say where each one goes."""
    from radixserve.curve import CLIENTS_DIR, SERVER_NAME, CurveError, write_keys

    clients = args.clients or (["client"] if args.server else [])
    if not clients and not args.server:
        print("radixserve keys: nothing to write (--no-server and no --client)", file=sys.stderr)
        return 2
    try:
        written = write_keys(args.dir, clients, args.server)
    except (CurveError, OSError) as e:
        print(f"radixserve keys: {e}", file=sys.stderr)
        return 1
    for path in written:
        kind = "secret, mode 0600" if path.suffix == ".key_secret" else "public"
        print(f"wrote {path} ({kind})")
    d = args.dir.rstrip("/") or "/"
    server_secret, server_public = f"{d}/{SERVER_NAME}.key_secret", f"{d}/{SERVER_NAME}.key"
    if args.server and not any(p.name == f"{SERVER_NAME}.key_secret" for p in written):
        print(f"kept {server_secret} (it exists)")
    print(
        f"\nserver: radixserve launch --host 0.0.0.0 --curve-secret-key {server_secret} "
        f"--curve-allowed-clients {d}/{CLIENTS_DIR}"
    )
    for name in clients:
        print(
            f"client {name}: Client('tcp://HOST:PORT', curve_server_key='{server_public}', "
            f"curve_client_key='{d}/{name}.key_secret')"
        )
    print(
        f"Keep {server_secret} on the server only; give each client {server_public} and "
        "its own .key_secret. To allow another client, put its public .key file into "
        f"{d}/{CLIENTS_DIR} and restart the server."
    )
    return 0
