"""A loopback relay in front of an agent's data plane that makes it a slow peer: every reply
frame is held ``reply_delay_s`` before it is forwarded (HELLO, PING, FETCH alike: a peer whose
answers come late but each within the reader's socket timeout), and while ``trickling`` is set a
FETCH reply's payload goes out ``piece_bytes`` at a time, one piece per ``piece_every_s`` (a
transfer whose every read is within the timeout while the whole is hopelessly slow). Requests
pass untouched. It counts the connections the puller closed (``closed_by_client``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

from kvctl.wire.protocol import HEADER, HEADER_BYTES, REPLY_BIT, Op
from tests.functional.raw_sockets import recv_exactly


@dataclass
class SlowRelay:
    target: tuple[str, int]
    reply_delay_s: float = 0.0
    piece_bytes: int = 4096
    piece_every_s: float = 0.05
    trickling: threading.Event = field(default_factory=threading.Event)
    #: connections whose client end (the puller) closed or reset them
    closed_by_client: int = 0
    address: str = ""

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True, name="slow-relay")
        self._thread.start()

    def _upstream(
        self, client: socket.socket, server: socket.socket, ended: threading.Event
    ) -> None:
        try:
            while data := client.recv(1 << 16):
                server.sendall(data)
        except OSError:
            pass
        if not (self._stop.is_set() or ended.is_set()):  # not closed by this relay
            with self._lock:
                self.closed_by_client += 1
        with contextlib.suppress(OSError):
            server.close()

    def _downstream(
        self, server: socket.socket, client: socket.socket, ended: threading.Event
    ) -> None:
        try:
            while not self._stop.is_set():
                try:
                    head = recv_exactly(server, HEADER_BYTES)
                    _magic, _ver, op, _rid, meta_len, payload_len = HEADER.unpack(head)
                    meta = recv_exactly(server, meta_len)
                    body = recv_exactly(server, payload_len)
                except (OSError, ConnectionError):  # the agent's end closed: the relay's doing
                    ended.set()
                    return
                if self.reply_delay_s:
                    time.sleep(self.reply_delay_s)
                client.sendall(head + meta)
                if op == Op.FETCH | REPLY_BIT and self.trickling.is_set():
                    for at in range(0, len(body), self.piece_bytes):
                        client.sendall(body[at : at + self.piece_bytes])
                        if self._stop.wait(self.piece_every_s):
                            return
                else:
                    client.sendall(body)
        except OSError:  # the puller's end closed (counted by ``_upstream``)
            pass
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)

    def _serve(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._socks += [client, server]
            ended = threading.Event()  # set when the relay ends the connection itself
            for pump, args in (
                (self._upstream, (client, server, ended)),
                (self._downstream, (server, client, ended)),
            ):
                threading.Thread(target=pump, args=args, daemon=True, name="slow-relay").start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
