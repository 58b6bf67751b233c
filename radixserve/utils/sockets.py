"""Non-blocking reads of a ZeroMQ socket: ``None`` when nothing is waiting, so a poll
loop drains a socket with ``while (x := recv(sock)) is not None``."""

from __future__ import annotations

import zmq


def recv(sock: zmq.Socket) -> bytes | None:
    try:
        return sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame] | None:
    try:
        return sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None


def recv_multipart(sock: zmq.Socket) -> list[bytes] | None:
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None
