"""The workers' side channel on the wire: a listener, pickled messages with a length prefix,
and raw bytes received into a buffer. One module for everything that talks worker to worker
over TCP (replication.py's replicas, local_recovery.py's fetch of a replica from a peer's
disk), so the framing is spelled once.

Only peer workers of the same job connect (their addresses are in the job's side store), so
an object on the wire is trusted as a pickle is between the processes of one job.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

__all__ = ["listen", "recv_exact", "recv_into", "recv_obj", "send_obj"]

#: The length prefix of a pickled message.
_LEN = struct.Struct("!Q")


def listen() -> socket.socket:
    """A listening socket on a free port of every interface (as a ``TCPStore`` server binds)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


def send_obj(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOFError if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer closed the connection")
        got += n


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_obj(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    return pickle.loads(recv_exact(sock, n))  # noqa: S301 - a peer worker of this job
