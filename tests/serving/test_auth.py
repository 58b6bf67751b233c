"""Authentication on the public socket: CURVE keys (``radixserve keys``, the launch
checks, clients with right, wrong and missing keys) and the admin key on
``flush_cache`` / ``check``. One server is launched, on loopback, with CURVE, an
allowed-clients directory, the admin key and the HTTP front."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.auth

from radixserve.cli import main as cli_main
from radixserve.client import AsyncClient, Client, ConnectionLost, ServerError
from radixserve.http.auth import ADMIN_KEY_ENV
from radixserve.launch import LaunchError, check_public_socket
from radixserve.server_config import ServerConfig
from tests.helpers.server import Server, wait_idle

ADMIN = "admin-" + os.urandom(6).hex()
FAIL_FAST_S = 5.0  # a refused client must know well before any request timeout


def make_keys(folder: Path, *args: str) -> None:
    assert cli_main(["keys", str(folder), *args]) == 0


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys") / "k"
    make_keys(folder)
    return folder


@pytest.fixture(scope="module")
def curve_server(model_dir, keys, monkeypatch_module):
    monkeypatch_module.delenv(ADMIN_KEY_ENV, raising=False)
    srv = Server(
        model_dir,
        *("--num-pages", "64", "--http-port", "0"),
        *("--curve-secret-key", str(keys / "server.key_secret")),
        *("--curve-allowed-clients", str(keys / "clients")),
        env={ADMIN_KEY_ENV: ADMIN},
    )
    yield srv
    assert srv.stop() == 0
    assert srv.orphans() == []


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def allowed(srv: Server, keys: Path, **kw) -> Client:
    return Client(
        srv.endpoint,
        timeout=60,
        curve_server_key=keys / "server.key",
        curve_client_key=keys / "client.key_secret",
        **kw,
    )


# ------------------------------------------------------------ no server needed
def test_launch_refuses_a_public_bind_without_keys(capsys, keys, tmp_path):
    with pytest.raises(LaunchError, match="radixserve keys.*--curve-secret-key"):
        check_public_socket(ServerConfig(host="0.0.0.0"))
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_public_socket(ServerConfig(host=host))  # loopback: no keys needed
    secret = str(keys / "server.key_secret")
    with pytest.raises(LaunchError, match="exactly one of --curve-allowed-clients"):
        check_public_socket(ServerConfig(host="0.0.0.0", curve_secret_key=secret))
    with pytest.raises(LaunchError, match="no secret key"):
        check_public_socket(
            ServerConfig(curve_secret_key=str(keys / "server.key"), curve_allow_any_client=True)
        )
    with pytest.raises(LaunchError, match="no public certificate"):
        check_public_socket(
            ServerConfig(curve_secret_key=secret, curve_allowed_clients=str(tmp_path))
        )
    check_public_socket(ServerConfig(host="0.0.0.0", curve_secret_key=secret,
                                     curve_allowed_clients=str(keys / "clients")))  # fmt: skip
    # The command refuses before it starts anything.
    assert cli_main(["launch", "--host", "0.0.0.0", "--model", "/nonexistent"]) == 1
    assert "run `radixserve keys DIR`" in capsys.readouterr().err


def test_keys_writes_usable_certificates_with_private_secrets(tmp_path, keys):
    for name in ("server", "client"):
        secret = keys / f"{name}.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        public, secret_key = zmq.auth.load_certificate(secret)
        assert secret_key is not None and zmq.curve_public(secret_key) == public
    assert zmq.auth.load_certificate(keys / "server.key")[1] is None
    assert zmq.auth.load_certificates(keys / "clients") == {
        zmq.auth.load_certificate(keys / "client.key_secret")[0]: True
    }
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    # More clients, later: the server's certificate is kept, nothing is overwritten.
    before = (keys / "server.key_secret").read_bytes()
    folder = tmp_path / "more"
    folder.mkdir()
    for p in keys.rglob("*"):
        if p.is_file():
            (folder / p.relative_to(keys)).parent.mkdir(exist_ok=True)
            (folder / p.relative_to(keys)).write_bytes(p.read_bytes())
    make_keys(folder, "--client", "alice", "--client", "bob")
    assert (folder / "server.key_secret").read_bytes() == before
    assert len(zmq.auth.load_certificates(folder / "clients")) == 3
    assert cli_main(["keys", str(folder), "--client", "alice"]) == 1  # exists already


def test_client_keys_are_checked_before_connecting(keys):
    with pytest.raises(ValueError, match="needs curve_server_key"):
        Client("tcp://127.0.0.1:1", curve_client_key=keys / "client.key_secret")
    with pytest.raises(ValueError, match="no such certificate file"):
        Client("tcp://127.0.0.1:1", curve_server_key=keys / "missing.key")
    public, _ = zmq.curve_keypair()
    _, other_secret = zmq.curve_keypair()
    with pytest.raises(ValueError, match="not the secret key's"):
        Client(
            "tcp://127.0.0.1:1", curve_server_key=public, curve_client_key=(public, other_secret)
        )


# ------------------------------------------------------------- a CURVE server
def test_allowed_client_generates_and_admin_calls_need_the_admin_key(curve_server, keys):
    with allowed(curve_server, keys) as c:
        r = c.generate("Hello", max_tokens=4, temperature=0.0)
        assert r.finish_reason == "length" and len(r.token_ids) == 4
        assert c.stats()["num_pages"] == 64  # not an admin call
        with pytest.raises(ServerError, match="needs the server's admin API key"):
            c.flush_cache()
        with pytest.raises(ServerError, match="wrong admin API key"):
            c.check(admin_key="not-" + ADMIN)
        assert c.flush_cache(admin_key=ADMIN) >= 0
        wait_idle(c)
        assert c.check(admin_key=ADMIN) == {"ok": True, "error": None}
    with allowed(curve_server, keys, admin_key=ADMIN) as c:  # the client's own key
        assert c.check()["ok"]


def test_async_client_with_keys(curve_server, keys):
    async def run() -> None:
        async with AsyncClient(
            curve_server.endpoint,
            timeout=60,
            curve_server_key=zmq.auth.load_certificate(keys / "server.key")[0].decode(),
            curve_client_key=zmq.auth.load_certificate(keys / "client.key_secret"),
            admin_key=ADMIN,
        ) as c:
            r = await c.generate("Hi", max_tokens=2, temperature=0.0)
            assert len(r.token_ids) == 2
            assert (await c.check())["ok"]

    asyncio.run(run())


def _stranger(kind: str, keys: Path) -> dict:
    server = keys / "server.key"
    if kind == "no keys":
        return {}
    if kind == "wrong server key":
        return {"curve_server_key": zmq.curve_keypair()[0],
                "curve_client_key": keys / "client.key_secret"}  # fmt: skip
    return {"curve_server_key": server}  # a fresh key pair, not in the allowed directory


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("no keys", "requires CURVE"),
        ("wrong server key", "is curve_server_key the server's public key"),
        ("unlisted client key", "refused this client's CURVE key"),
    ],
)
def test_clients_without_the_right_keys_fail_fast(curve_server, keys, kind, words):
    with Client(curve_server.endpoint, timeout=60, **_stranger(kind, keys)) as c:
        start = time.monotonic()
        with pytest.raises(ConnectionLost, match=f"authentication.*{words}"):
            c.generate("Hello", max_tokens=4)
        assert time.monotonic() - start < FAIL_FAST_S
        with pytest.raises(ConnectionLost, match="authentication"):
            c.stats()  # refused at once from now on


@pytest.mark.parametrize("kind", ["no keys", "wrong server key", "unlisted client key"])
def test_async_client_without_the_right_keys_fails_fast(curve_server, keys, kind):
    async def run() -> None:
        async with AsyncClient(curve_server.endpoint, timeout=60, **_stranger(kind, keys)) as c:
            with pytest.raises(ConnectionLost, match="authentication"):
                await asyncio.wait_for(c.generate("Hello", max_tokens=4), FAIL_FAST_S)
            with pytest.raises(ConnectionLost, match="authentication"):
                await asyncio.wait_for(c.stats(), FAIL_FAST_S)  # refused at once from now on
            await c.abort("never-sent")  # dropped, not waited on for ever

    asyncio.run(run())


def test_http_front_passes_the_admin_key_and_no_command_line_shows_it(curve_server):
    # The front reaches the tokenizer over the run dir's ipc endpoint, which has no CURVE.
    url = curve_server.http_url
    assert httpx.post(f"{url}/flush_cache").status_code == 401
    ok = httpx.post(f"{url}/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"})
    assert ok.status_code == 200 and ok.json()["freed_pages"] >= 0
    for name, pid in curve_server.pids.items():
        assert ADMIN.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), name
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert (ADMIN.encode() in environ) == (name in ("tokenizer", "http")), name
