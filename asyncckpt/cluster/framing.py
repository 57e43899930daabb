"""The workers' connections on the wire: one module for everything that talks worker to
worker over TCP (replication.py's replicas, local_recovery.py's fetch of a replica from a
peer's disk), so the format is spelled once.

Every connection starts with a mutual challenge-response (``handshake_client``,
``handshake_server``) before anything else is read: each side sends a random nonce and proves
it knows the run's secret (``DistConfig.secret``: made by rank 0's trainer at start, shared
with the side store's address) with an HMAC-SHA256 over both nonces, the service and its own
role, compared with ``hmac.compare_digest``; the server proves first, so a client never sends
a byte past its opener to a listener that is not the run's. The handshake has
``HANDSHAKE_S`` seconds. A listener that refuses a peer closes the connection and changes
nothing else (the caller logs who and why).

A message is a JSON header with a length prefix, then the raw byte segments it declares:

    !I length | JSON object {"kind": ..., ..., "segments": [n0, n1, ...]} | n0 bytes | n1 ...

Nothing on a socket is unpickled: a header is parsed as JSON (at most ``MAX_HEADER_BYTES``,
checked before anything is allocated for it) and read field by field by its receiver; bytes
travel as segments, whose total the receiver checks before it allocates them
(``recv_msg(segment_room=)``). The bulk of a transfer (a replica's arenas, a replica's files)
follows a message as plain bytes into buffers the receiver sized and checked itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("asyncckpt")

__all__ = [
    "MAGIC",
    "MAX_HEADER_BYTES",
    "AuthError",
    "Message",
    "ProtocolError",
    "encode_header",
    "handshake_client",
    "handshake_server",
    "listen",
    "recv_exact",
    "recv_into",
    "recv_msg",
    "send_msg",
]

#: The length prefix of a message's JSON header.
_LEN = struct.Struct("!I")
#: The largest header read (a replica's specs: ~150 bytes a tensor, 64 MiB covers 400,000).
MAX_HEADER_BYTES = 64 << 20
#: The most segments one message declares.
MAX_SEGMENTS = 1 << 20


class ProtocolError(ConnectionError):
    """A peer's message that breaks the format: the connection is dropped, nothing is kept."""


class AuthError(ConnectionError):
    """The peer did not prove it belongs to the run: nothing it sent is read."""


# ------------------------------------------------------------------ the handshake

#: A connection's first bytes: the protocol and its version.
MAGIC = b"ACKPT-W1"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
#: Seconds a peer has for the whole handshake.
HANDSHAKE_S = 10.0


def _proof(secret: str, role: bytes, service: str, client: bytes, server: bytes) -> bytes:
    if not secret:
        raise ValueError(
            "no run secret (DistConfig.secret is empty): the workers' connections are "
            "authenticated with the secret rank 0 publishes at start"
        )
    msg = b"\0".join((b"asyncckpt", role, service.encode(), client, server))
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


@contextlib.contextmanager
def _handshake_deadline(sock: socket.socket) -> Iterator[None]:
    before = sock.gettimeout()
    sock.settimeout(HANDSHAKE_S)
    try:
        yield
    except (EOFError, TimeoutError) as e:
        raise AuthError(f"it did not prove it belongs to the run ({e or 'timed out'})") from None
    finally:
        sock.settimeout(before)


def handshake_client(sock: socket.socket, secret: str, service: str) -> None:
    """The connecting side: check the listener's proof of ``secret`` for ``service``, then
    prove it in turn. AuthError (nothing more sent) if the listener is not the run's."""
    with _handshake_deadline(sock):
        mine = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + mine)
        reply = recv_exact(sock, len(MAGIC) + NONCE_BYTES + MAC_BYTES)
        theirs, proof = reply[len(MAGIC) : -MAC_BYTES], reply[-MAC_BYTES:]
        want = _proof(secret, b"server", service, mine, theirs)
        if reply[: len(MAGIC)] != MAGIC or not hmac.compare_digest(proof, want):
            raise AuthError(f"the listener did not prove it belongs to the run ({service})")
        sock.sendall(_proof(secret, b"client", service, mine, theirs))


def handshake_server(sock: socket.socket, secret: str, service: str) -> None:
    """The listening side, before anything else is read: AuthError if the peer does not
    prove it knows ``secret`` for ``service``."""
    with _handshake_deadline(sock):
        opener = recv_exact(sock, len(MAGIC) + NONCE_BYTES)
        if opener[: len(MAGIC)] != MAGIC:
            raise AuthError(
                "it does not speak this protocol: it did not prove it belongs to the run"
            )
        theirs, mine = opener[len(MAGIC) :], os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + mine + _proof(secret, b"server", service, theirs, mine))
        proof = recv_exact(sock, MAC_BYTES)
        if not hmac.compare_digest(proof, _proof(secret, b"client", service, theirs, mine)):
            raise AuthError(f"it did not prove it belongs to the run ({service}): wrong proof")


#: Where every listener binds instead of the address its node publishes, for a machine whose
#: published address is not one of its own (behind NAT): its own address there, or ``0.0.0.0``
#: / ``::`` for every interface (what torch's ``TCPStore`` binds).
BIND_ENV = "ASYNCCKPT_BIND_HOST"


def listen(host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on a free port of ``host``, the address its node publishes for it
    (the side store's, ``ASYNCCKPT_STORE_HOST``; a worker's, ``ASYNCCKPT_REPLICA_HOST``):
    peers connect there, and nothing reaches it through the machine's other interfaces. (It
    used to bind every interface; a listener anybody reaches is one more door.)
    ``$ASYNCCKPT_BIND_HOST`` binds another address instead (see ``BIND_ENV``)."""
    bind = os.environ.get(BIND_ENV) or host
    try:
        infos = socket.getaddrinfo(bind, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {bind!r}: the name does not resolve ({e})") from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # (IPv4 first, as clients try it first)
    errors = []
    for family, _, _, _, address in infos:
        try:
            sock = socket.create_server(address, family=family)
        except OSError as e:
            errors.append(f"{address[0]}: {e.strerror or e}")
            continue
        _warn_if_unreachable(bind, str(address[0]))
        return sock
    raise OSError(
        f"cannot listen on {bind!r} ({'; '.join(errors)}): it is not an address of this "
        f"machine; publish one that is, or set ${BIND_ENV} to the local address to listen on"
    )


def _warn_if_unreachable(name: str, ip: str) -> None:
    """A machine name that resolves to a loopback address here (``127.0.1.1`` in Debian's
    /etc/hosts) binds a listener other machines never reach: said once per name."""
    try:
        ipaddress.ip_address(name)
        return  # (an address, not a name: meant as it is)
    except ValueError:
        pass
    if name != "localhost" and ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        if name not in _warned:
            _warned.add(name)
            log.warning(
                "%s resolves to %s on this machine: a listener there is reachable from this "
                "machine only (fine for a job on one machine). On several machines, set "
                "ASYNCCKPT_STORE_HOST / ASYNCCKPT_REPLICA_HOST to this machine's address on the "
                "job's network (or %s)",
                name,
                ip,
                BIND_ENV,
            )


_warned: set[str] = set()


# ------------------------------------------------------------------ messages


@dataclass(frozen=True)
class Message:
    """A header (``kind`` and its fields, as JSON parsed them) and its byte segments."""

    header: dict[str, Any]
    segments: list[bytes]

    @property
    def kind(self) -> str:
        return str(self.header["kind"])


def encode_header(header: Mapping[str, Any]) -> bytes:
    """A header's bytes on the wire, its length first."""
    data = json.dumps(header, separators=(",", ":")).encode()
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(
            f"a {header.get('kind')!r} header of {len(data)} bytes is over the "
            f"{MAX_HEADER_BYTES} bytes a peer reads"
        )
    return _LEN.pack(len(data)) + data


def send_msg(
    sock: socket.socket,
    header: Mapping[str, Any],
    segments: Sequence[bytes | memoryview] = (),
) -> None:
    """Send one message: ``header`` (a JSON object with a ``"kind"``) and ``segments``."""
    if segments:
        header = {**header, "segments": [len(s) for s in segments]}
    sock.sendall(encode_header(header))
    for s in segments:
        sock.sendall(s)


def recv_msg(sock: socket.socket, *, segment_room: Callable[[int], None] | None = None) -> Message:
    """Read one message. ``segment_room(total)`` is called with its segments' total size
    before they are allocated; if it raises, the segments are read past (into one small
    buffer, so the connection stays in step) and its error is raised. Without it, a message
    that declares segments is refused. ProtocolError for anything malformed."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_HEADER_BYTES:
        raise ProtocolError(f"a header of {n} bytes, over the {MAX_HEADER_BYTES} bytes read")
    try:
        header = json.loads(recv_exact(sock, n))
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ProtocolError(f"a header that is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise ProtocolError("a header that is not a JSON object with a string 'kind'")
    sizes = header.pop("segments", [])
    if (
        not isinstance(sizes, list)
        or len(sizes) > MAX_SEGMENTS
        or not all(type(s) is int and s >= 0 for s in sizes)
    ):
        raise ProtocolError(f"a {header['kind']!r} header with malformed segment sizes")
    total = sum(sizes)
    if total:
        if segment_room is None:
            raise ProtocolError(f"a {header['kind']!r} message carries no segments")
        try:
            segment_room(total)
        except Exception:
            _skip(sock, total)
            raise
    return Message(header, [recv_exact(sock, s) for s in sizes])


def _skip(sock: socket.socket, n: int) -> None:
    """Read ``n`` bytes and keep none of them."""
    buf = memoryview(bytearray(min(n, 1 << 20)))
    while n:
        k = min(n, len(buf))
        recv_into(sock, buf[:k])
        n -= k


def expect(msg: Message, *kinds: str) -> Message:
    """``msg`` if it is one of ``kinds``; else ProtocolError."""
    if msg.kind not in kinds:
        raise ProtocolError(f"expected a message of kind {' or '.join(kinds)}, got {msg.kind!r}")
    return msg


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
