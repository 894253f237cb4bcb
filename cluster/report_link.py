"""The report link: a group's reports leave its leader over one TCP connection, not Ray calls.

A report a step (:class:`cluster.group_messages.GroupReport`) went out as the answer to a Ray long
poll. Each such call runs Ray's task machinery (task spec, tracing wrapper, its serialization
context, a thread hand-off) in the leader's process, under the GIL the engine loop needs between
its CUDA calls, and again in the Serve replica that polls. vLLM's engine core answers its API
server over a ZMQ socket for the same reason. Here the leader's :class:`ReportServer` listens on its
node's address; the fleet's :class:`ReportReader` connects once per generation and reads frames:

    8-byte big-endian length | pickle (protocol 5) of one GroupReport

The server's thread takes a report (waiting up to :data:`HEARTBEAT_S` for one, so an idle or stuck
leader still sends a heartbeat carrying how long its step has run), pickles and sends it; its
waits are a condition and ``sendall``, so it holds the GIL only to pickle. Commands still go in as
Ray calls (one batch per fleet loop iteration, not per step).

Invariants (owner: :class:`ReportServer`):
- only a client that first sends the 32-byte token handed out with the address (through Ray,
  which authenticates its own calls) is answered, and nothing it sends is unpickled;
- one connection per generation: reports taken for a connection that breaks are lost, so a broken
  link is the generation's failure on the fleet side, never a reconnect;
- the listening socket binds the node's address (127.0.0.1 on a test cluster), never 0.0.0.0.
"""

from __future__ import annotations

import hmac
import logging
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cluster.threads import name_os_thread

log = logging.getLogger(__name__)

#: The longest the server waits for a report before it sends one anyway (a heartbeat).
HEARTBEAT_S = 1.0
#: How often an unconnected server looks whether it was closed (closing a socket does not wake
#: a thread blocked in its ``accept`` on Linux).
_ACCEPT_LOOK_S = 1.0
_HEADER = struct.Struct("!Q")
_TOKEN_BYTES = 32
#: A frame larger than this is refused as corrupt (a report of every event of a long stall stays
#: far below it).
MAX_FRAME_BYTES = 1 << 30


class LinkClosed(ConnectionError):
    """The other end closed the link, or it broke."""


@dataclass(frozen=True)
class LinkAddress:
    """Where a generation's report server listens, and the token a client proves itself with."""

    host: str
    port: int
    token: bytes


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LinkClosed(f"the link closed after {got} of {n} bytes")
        got += k
    return buf


class ReportServer:
    """Sends ``take(HEARTBEAT_S)``'s reports to the one client that connects (see the module
    docstring), on a thread of its own, until ``stopped()`` is true after a take or the link breaks."""

    def __init__(self, host: str, take: Callable[[float], object], stopped: Callable[[], bool]) -> None:
        self._take, self._stopped = take, stopped
        self._token = os.urandom(_TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_ACCEPT_LOOK_S)
        self.address = LinkAddress(host, self._listener.getsockname()[1], self._token)
        self._conn: socket.socket | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="report-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and sending (the thread ends at its next take or send)."""
        self._closed.set()
        for s in (self._listener, self._conn):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> socket.socket | None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return None
            try:
                conn.settimeout(10.0)
                token = bytes(_recv_exact(conn, _TOKEN_BYTES))
            except (OSError, LinkClosed):
                conn.close()
                continue
            if not hmac.compare_digest(token, self._token):
                log.warning("report link: refused a client from %s with a wrong token", peer)
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        return None

    def _serve(self) -> None:
        name_os_thread("report-link")
        conn = self._conn = self._accept()
        try:
            self._listener.close()
        except OSError:
            pass
        if conn is None:
            return
        try:
            while not self._closed.is_set():
                report = self._take(HEARTBEAT_S)
                data = pickle.dumps(report, protocol=5)
                conn.sendall(_HEADER.pack(len(data)) + data)
                if self._stopped():
                    return
        except OSError as e:
            if not self._closed.is_set():
                log.warning("report link: the fleet's end broke: %s", e)
        finally:
            try:
                conn.close()
            except OSError:
                pass


class ReportReader:
    """The fleet's end of a generation's report link: :meth:`read` returns the next report."""

    def __init__(self, address: LinkAddress, connect_timeout_s: float = 10.0) -> None:
        self._sock = socket.create_connection((address.host, address.port), timeout=connect_timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(address.token)

    def read(self, timeout_s: float):
        """The next report; ``TimeoutError`` when none came within ``timeout_s`` (the link is then
        unusable: a frame may be half read), :class:`LinkClosed` when the link ended."""
        try:
            # Inside the try: a close() from another thread just before this read makes even the
            # timeout call fail (EBADF), and that too is the link ending, not a fault of the read.
            self._sock.settimeout(timeout_s)
            (size,) = _HEADER.unpack(_recv_exact(self._sock, _HEADER.size))
            if size > MAX_FRAME_BYTES:
                raise LinkClosed(f"a frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
            return pickle.loads(_recv_exact(self._sock, size))
        except TimeoutError:
            raise
        except OSError as e:
            raise LinkClosed(f"{type(e).__name__}: {e}") from e

    def close(self) -> None:
        """End the link; a :meth:`read` blocked in another thread raises :class:`LinkClosed`."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
