"""CURVE keys for the public ZeroMQ socket: certificate files, and which binds need them.

ZeroMQ's CURVE mechanism (CurveZMQ) encrypts a connection and authenticates the
server to the client by its public key; the server authenticates a client by the
client's public key, through a ZAP handler (``radixserve/zap.py``).
Keys are 40-character Z85 strings; they are kept in pyzmq's certificate files
(``zmq.auth``): ``NAME.key`` holds a public key, ``NAME.key_secret`` the public and
the secret key (mode 0600).

``radixserve keys DIR`` (``write_keys``) lays a directory out as:

    DIR/server.key          the server's public key: every client needs it
    DIR/server.key_secret   the server's secret key: ``--curve-secret-key``
    DIR/clients/NAME.key    each client's public key: ``--curve-allowed-clients DIR/clients``
    DIR/NAME.key_secret     each client's key pair: the client's ``curve_client_key``

Secret keys travel only as file paths (a path on a command line reveals nothing);
nothing here accepts a secret key as a flag's value.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

Z85_KEY_LEN = 40
SERVER_NAME = "server"
CLIENTS_DIR = "clients"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


class CurveError(ValueError):
    """A key file or key that cannot be used; the message says which and why."""


def require_curve() -> None:
    """Raise unless this libzmq was built with CURVE (libsodium or tweetnacl)."""
    if not zmq.has("curve"):
        raise CurveError(
            f"this libzmq ({zmq.zmq_version()}) has no CURVE support: install a pyzmq "
            "whose bundled libzmq has it (the official wheels do)"
        )


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` (a ``--host`` value) only listens on this machine:
    ``localhost``, 127.0.0.0/8 or ::1. Anything else (``0.0.0.0``, ``*``, an
    interface name, another host name) counts as reachable from the network."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_secret_certificate(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from a secret certificate (``NAME.key_secret``)."""
    public, secret = _load(path)
    if secret is None:
        raise CurveError(
            f"{path} holds no secret key: pass the .key_secret file (the .key file is "
            "the public half)"
        )
    return public, secret


def load_public_key(key: str | bytes | os.PathLike) -> bytes:
    """A public Z85 key: the key itself (40 characters), or a certificate file's."""
    if isinstance(key, (str, bytes)) and len(key) == Z85_KEY_LEN and not os.path.exists(key):
        raw = key.encode() if isinstance(key, str) else key
        _check_z85(raw, "the public key")
        return raw
    return _load(key)[0]


def load_allowed_keys(
    directory: str | os.PathLike, flag: str = "--curve-allowed-clients"
) -> frozenset[bytes]:
    """The public keys of every ``*.key`` certificate in ``directory`` (at least one);
    errors name ``directory`` as the value of ``flag``."""
    folder = Path(directory)
    if not folder.is_dir():
        raise CurveError(f"{flag} {directory}: not a directory")
    keys = frozenset(_load(p)[0] for p in sorted(folder.glob("*.key")))
    if not keys:
        raise CurveError(
            f"{flag} {directory}: no public certificate (*.key) in it, so no peer "
            "could connect (`radixserve keys` writes them)"
        )
    return keys


def make_curve_server(sock: zmq.Socket, public: bytes, secret: bytes) -> None:
    """Make ``sock``'s next binds CURVE servers with these keys, their clients judged by
    the ZAP handler of the ``radixserve`` domain (zap.py), which the caller
    runs. ZeroMQ applies security options to the binds made after they are set."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"radixserve")


def secret_file_problem(path: str | os.PathLike) -> str | None:
    """Why a secret certificate's permissions are unsafe (group or others may read
    it), or None."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"{path} is readable by other users (mode {stat.S_IMODE(mode):04o}): chmod 600 it"
    return None


def write_keys(directory: str | os.PathLike, clients: list[str], server: bool) -> list[Path]:
    """Write certificates into ``directory`` (laid out as the module docstring says):
    the server's unless ``server`` is False or it exists already, and one per name in
    ``clients``. Secret files get mode 0600, the directory 0700 when it is created.
    Never overwrites: a client name already there raises before anything is written.
    Returns the paths written."""
    root = Path(directory)
    for name in clients:
        if not _NAME.match(name) or name == SERVER_NAME:
            raise CurveError(
                f"client name {name!r}: use letters, digits, '_', '.', '-' (not 'server')"
            )
        for path in (root / f"{name}.key_secret", root / CLIENTS_DIR / f"{name}.key"):
            if path.exists():
                raise CurveError(f"{path} exists already: choose another name or remove it")
    if len(set(clients)) != len(clients):
        raise CurveError("each client name may be given once")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    (root / CLIENTS_DIR).mkdir(mode=0o755, exist_ok=True)
    written: list[Path] = []
    if server and not (root / f"{SERVER_NAME}.key_secret").exists():
        written += _create(root, SERVER_NAME)
    for name in clients:
        public, secret = _create(root, name)
        moved = root / CLIENTS_DIR / public.name
        public.replace(moved)
        written += [moved, secret]
    return written


def _create(root: Path, name: str) -> list[Path]:
    # The umask makes every file private from its first byte; public ones are then opened up.
    old = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(root, name)
    finally:
        os.umask(old)
    os.chmod(public, 0o644)
    return [Path(public), Path(secret)]


def _load(path: str | bytes | os.PathLike) -> tuple[bytes, bytes | None]:
    if isinstance(path, bytes):
        path = path.decode(errors="replace")
    if not os.path.isfile(path):
        raise CurveError(f"{path}: no such certificate file (nor a 40-character Z85 key)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: not a ZeroMQ certificate ({e})") from None
    _check_z85(public, f"{path}'s public key")
    if secret is not None:
        _check_z85(secret, f"{path}'s secret key")
    return public, secret


def _check_z85(key: bytes, what: str) -> None:
    with contextlib.suppress(ValueError, KeyError, IndexError):
        if len(key) == Z85_KEY_LEN and len(z85.decode(key)) == 32:
            return
    raise CurveError(f"{what} is not a 40-character Z85 key")
