"""Several nodes: where the worker ranks of one server meet, and what they must prove.

``radixserve launch --nnodes N --node-rank R --dist-init-addr HOST:PORT --tp T`` runs
node ``R`` of ``N``; node ``R`` runs ranks ``R * T/N`` .. ``(R + 1) * T/N - 1``
(``ServerConfig.local_ranks``). The head (node 0) runs the tokenizer, the scheduler
and rank 0; every other node runs only its ranks. On the head:

- ``HOST:PORT`` is the rendezvous store (a torch ``TCPStore`` bound to exactly that
  address: ``worker/rendezvous.py``), through which every rank joins the group;
- ``HOST:PORT+1`` is the step relay (``worker/relay.py``): rank 0 forwards each
  ``Step``'s msgpack bytes over it to the ranks of the other nodes. It is a CURVE
  server when the head has ``--curve-node-key``: only the nodes whose public
  certificates are in ``--curve-allowed-nodes`` may connect (the steps carry every
  request's tokens).

``check_nodes`` refuses, before anything starts, a layout that cannot work and a
non-loopback ``HOST`` without CURVE keys. On loopback the keys are optional (every
rank is on this machine, as in the tests); the store and the collectives' own
sockets (gloo, NCCL) are never authenticated, so across machines they need a
private network (docs/parallel.md).
"""

from __future__ import annotations

import logging
import socket

from radixserve.curve import (
    CurveError,
    is_loopback,
    load_allowed_keys,
    load_public_key,
    load_secret_certificate,
    require_curve,
    secret_file_problem,
)
from radixserve.server_config import ServerConfig

log = logging.getLogger("radixserve.launch")


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port); ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(
            f"--dist-init-addr {text!r}: expected HOST:PORT with PORT in 1..65534 "
            "(PORT + 1 is taken too)"
        )
    return host, int(port)


def relay_endpoint(config: ServerConfig, bind: bool = False) -> str:
    """The head's step relay for the other nodes: ``tcp://HOST:PORT+1`` (to bind: with a
    host name resolved to its address, since ZeroMQ binds addresses and interfaces)."""
    assert config.dist_init_addr is not None
    host, port = parse_addr(config.dist_init_addr)
    if bind:
        host = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{port + 1}"


def check_nodes(config: ServerConfig) -> None:
    """ValueError (saying what to pass) unless the node layout and its keys can work."""
    tp, nnodes, rank = config.engine.tp, config.nnodes, config.node_rank
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= rank < nnodes:
        raise ValueError(f"--node-rank {rank} is not in 0 .. --nnodes - 1 ({nnodes - 1})")
    if tp % nnodes:
        raise ValueError(
            f"--tp {tp} cannot be spread over --nnodes {nnodes}: each node runs --tp / "
            "--nnodes worker ranks, so --tp must be a multiple of --nnodes"
        )
    if nnodes > 1 and config.dist_init_addr is None:
        raise ValueError(
            "--nnodes > 1 needs --dist-init-addr HOST:PORT, an address of the head node "
            "(--node-rank 0) that every node can reach"
        )
    if config.dist_init_addr is not None:
        host, _ = parse_addr(config.dist_init_addr)
    if config.curve_allowed_nodes and (rank != 0 or not config.curve_node_key):
        raise ValueError(
            "--curve-allowed-nodes is for the head (--node-rank 0), with --curve-node-key"
        )
    if config.curve_head_key and (rank == 0 or not config.curve_node_key):
        raise ValueError("--curve-head-key is for a node > 0 (--node-rank), with --curve-node-key")
    if nnodes == 1:
        if config.curve_node_key:
            raise ValueError("--curve-node-key is for --nnodes > 1")
        return
    keys = config.curve_allowed_nodes if rank == 0 else config.curve_head_key
    if config.curve_node_key and not keys:
        want = "--curve-allowed-nodes DIR" if rank == 0 else "--curve-head-key FILE"
        raise ValueError(f"--curve-node-key on node {rank} needs {want}")
    if not config.curve_node_key and not is_loopback(host):
        raise ValueError(
            f"--dist-init-addr {config.dist_init_addr} is not a loopback address, so the "
            "step relay between the nodes needs CURVE keys: `radixserve keys DIR --no-server "
            "--client head --client node1 ...`, then on the head --curve-node-key "
            "DIR/head.key_secret --curve-allowed-nodes DIR/clients, and on node R "
            "--curve-node-key DIR/nodeR.key_secret --curve-head-key DIR/clients/head.key "
            '(docs/parallel.md, "Several nodes")'
        )
    if not config.curve_node_key:
        return
    try:
        require_curve()
        load_secret_certificate(config.curve_node_key)
        if rank == 0:
            load_allowed_keys(config.curve_allowed_nodes, "--curve-allowed-nodes")
        else:
            load_public_key(config.curve_head_key)
    except CurveError as e:
        raise ValueError(str(e)) from None
    problem = secret_file_problem(config.curve_node_key)
    if problem:
        log.warning("--curve-node-key %s", problem)


def relay_server_keys(config: ServerConfig) -> tuple[bytes, bytes, frozenset[bytes]] | None:
    """The head's relay: its (public, secret) keys and the nodes it admits; None without
    ``--curve-node-key`` (loopback only)."""
    if not config.curve_node_key:
        return None
    require_curve()
    public, secret = load_secret_certificate(config.curve_node_key)
    assert config.curve_allowed_nodes is not None  # check_nodes
    return public, secret, load_allowed_keys(config.curve_allowed_nodes, "--curve-allowed-nodes")


def relay_client_keys(config: ServerConfig) -> tuple[bytes, bytes, bytes] | None:
    """A node > 0's side: (the head's public key, this node's public and secret keys)."""
    if not config.curve_node_key:
        return None
    require_curve()
    public, secret = load_secret_certificate(config.curve_node_key)
    assert config.curve_head_key is not None  # check_nodes
    return load_public_key(config.curve_head_key), public, secret
