"""A TCP proxy on loopback that can stop forwarding: a network stall between a client and its
database, for the fault-injection tests (and by hand: ``python scripts/stall_proxy.py 5432``).

While stalled, bytes already sent are held and new connections are accepted but not forwarded,
so clients see a silent network rather than an error. close() ends every connection.
lose_answer_to() cuts one connection the moment the server has answered a chosen statement:
the statement took effect, and its client cannot know (and, if asked, stalls from then on).
cut_before() cuts connections as they send a chosen statement, which never reaches the server;
cut_all() cuts every connection open now.
stall_before() stalls as a client sends a chosen statement, before it reaches the server.
freeze_connection_before() does so for that one connection only: the others flow on.
answer_with_mysql_error() answers a chosen statement with a MySQL error in the server's stead.
deliver_late() holds a chosen statement until deliver_held(), then delivers it, its client
gone or not: as TCP delivers what a client sent before it closed, once a partition heals.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import sys
import threading


class StallProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._losing: bytes | None = None  # see lose_answer_to
        self._stall_after_losing = False
        self.answers_lost = 0
        self._cutting: bytes | None = None  # see cut_before
        self._cuts_left = 0
        self.statements_cut = 0
        self._stalling: bytes | None = None  # see stall_before
        self._erring: tuple[bytes, int] | None = None  # see answer_with_mysql_error
        self._freezing: bytes | None = None  # see freeze_connection_before
        self.connections_frozen = 0
        self.errors_answered = 0
        self.stalled_before = threading.Event()
        self._holding: bytes | None = None  # see deliver_late
        self._cut_held_client = False
        self._held_release = threading.Event()
        self.held_delivered = threading.Event()
        threading.Thread(target=self._accept, name="stall-proxy", daemon=True).start()

    def stall(self) -> None:
        self._flowing.clear()

    def lose_answer_to(self, marker: bytes, then_stall: bool = False) -> None:
        """The next statement a client sends that contains ``marker`` reaches the server, and
        its connection is closed as the answer comes back, which the client never gets; with
        ``then_stall``, the proxy stalls at that moment (until ``resume``)."""
        with self._lock:
            self._losing, self._stall_after_losing = marker, then_stall

    def stop_losing(self) -> None:
        """Cancel a lose_answer_to(): if its statement has not come, no answer is lost; if it
        has and its answer is still to come, that answer is lost without stalling."""
        with self._lock:
            self._losing, self._stall_after_losing = None, False

    def cut_before(self, marker: bytes, times: int) -> None:
        """The next ``times`` statements a client sends that contain ``marker`` never reach
        the server: each one's connection is closed instead."""
        with self._lock:
            self._cutting, self._cuts_left = marker, times

    def stall_before(self, marker: bytes) -> None:
        """The next statement a client sends that contains ``marker`` stalls the proxy before
        it reaches the server (``stalled_before`` is set then), until ``resume``."""
        with self._lock:
            self._stalling = marker
            self.stalled_before.clear()

    def freeze_connection_before(self, marker: bytes) -> None:
        """The next statement a client sends that contains ``marker`` never reaches the server,
        and its connection forwards nothing more until close(): that connection alone is
        frozen (a server session hung on it), the others flow on."""
        with self._lock:
            self._freezing = marker

    def deliver_late(self, marker: bytes, cut_client: bool = False) -> None:
        """The next statement a client sends that contains ``marker`` is held, with whatever
        its connection sends after it, until ``deliver_held``: then it reaches the server
        (``held_delivered`` is set), even if its client has closed the connection meanwhile;
        the server's answers go to the client while it is there. The others flow on. With
        ``cut_client``, the client's end is reset at once: it sees its connection lost."""
        with self._lock:
            self._holding = marker
            self._cut_held_client = cut_client
            self._held_release.clear()
            self.held_delivered.clear()

    def deliver_held(self) -> None:
        self._held_release.set()

    def _holds(self, data: bytes) -> bool:
        with self._lock:
            if self._holding is None or self._holding not in data:
                return False
            self._holding = None
            return True

    def _deliver_late(self, client: socket.socket, server: socket.socket, held: bytes) -> None:
        """The rest of a connection whose statement ``held`` is delivered late."""
        chunks, client_open = [held], True
        if self._cut_held_client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # a reset: the client sees its connection lost
            client_open = False
        while not self._held_release.is_set() and not self._closed.is_set():
            watched = [server, client] if client_open else [server]
            readable, _, _ = select.select(watched, [], [], 0.05)
            for sock in readable:
                data = sock.recv(65536)
                if sock is client:
                    client_open = client_open and bool(data)
                    chunks += [data] if data else []
                elif not data:
                    return
                elif client_open:
                    client.sendall(data)
        if self._closed.is_set():
            return
        for chunk in chunks:
            server.sendall(chunk)
        self.held_delivered.set()
        if not client_open:
            server.shutdown(socket.SHUT_WR)
        # The server's answers, to the client if it is still there, until either end closes.
        peers = {client: server, server: client} if client_open else {server: client}
        while not self._closed.is_set():
            readable, _, _ = select.select(list(peers), [], [], 0.1)
            for sock in readable:
                data = sock.recv(65536)
                if not data:
                    return
                if sock is client or client_open:
                    peers[sock].sendall(data)

    def _freezes(self, data: bytes) -> bool:
        with self._lock:
            if self._freezing is None or self._freezing not in data:
                return False
            self._freezing = None
            self.connections_frozen += 1
            return True

    def answer_with_mysql_error(self, marker: bytes, errno: int) -> None:
        """The next statement a client sends that contains ``marker`` never reaches the server:
        the proxy answers it with MySQL error ``errno``, as the server would have (a deadlock,
        a lock wait timeout), and the connection goes on."""
        with self._lock:
            self._erring = (marker, errno)

    def _error_answer(self, data: bytes) -> bytes | None:
        """The error packet that answers ``data`` (a whole command packet), if it is the one."""
        with self._lock:
            if self._erring is None or self._erring[0] not in data:
                return None
            errno, self._erring = self._erring[1], None
            self.errors_answered += 1
        # ERR_Packet: 0xff, the error code, '#' and an SQLSTATE, the message; numbered one
        # past the command's own sequence number.
        payload = b"\xff" + struct.pack("<H", errno) + b"#40001injected by the test's proxy"
        return struct.pack("<I", len(payload))[:3] + bytes([(data[3] + 1) % 256]) + payload

    def _stalls_before(self, data: bytes) -> bool:
        with self._lock:
            if self._stalling is None or self._stalling not in data:
                return False
            self._stalling = None
            self.stall()
            self.stalled_before.set()
            return True

    def _cuts(self, data: bytes) -> bool:
        with self._lock:
            if self._cuts_left == 0 or self._cutting is None or self._cutting not in data:
                return False
            self._cuts_left -= 1
            self.statements_cut += 1
            return True

    def _loses_answer_to(self, data: bytes) -> bool:
        with self._lock:
            if self._losing is None or self._losing not in data:
                return False
            self._losing = None
            return True

    def resume(self) -> None:
        self._flowing.set()

    def cut_all(self) -> int:
        """Close every connection open now (clients see them reset); new ones are accepted as
        before. Returns how many were cut."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        return len(sockets) // 2

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._flowing.wait()
            if self._closed.is_set():
                client.close()
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        peers = {client: server, server: client}
        losing = False
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select(list(peers), [], [], 0.1)
                for sock in readable:
                    self._flowing.wait()  # a stall: hold the bytes, send nothing on
                    if self._closed.is_set():
                        return
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is server and losing:
                        if self._stall_after_losing:
                            self.stall()
                        self.answers_lost += 1
                        return  # the answer goes nowhere, and both ends are closed
                    if sock is client and self._holds(data):
                        self._deliver_late(client, server, data)
                        return
                    if sock is client and self._freezes(data):
                        self._closed.wait()  # held, never sent; the connection stays open
                        return
                    if sock is client and self._cuts(data):
                        return  # the statement goes nowhere, and both ends are closed
                    error = self._error_answer(data) if sock is client else None
                    if error is not None:
                        client.sendall(error)
                        continue
                    losing = losing or (sock is client and self._loses_answer_to(data))
                    if sock is client and self._stalls_before(data):
                        self._flowing.wait()
                        if self._closed.is_set():
                            return
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()


if __name__ == "__main__":
    proxy = StallProxy(int(sys.argv[1]))
    print(f"forwarding 127.0.0.1:{proxy.port} -> 127.0.0.1:{sys.argv[1]}; Enter toggles a stall")
    for _ in sys.stdin:
        (proxy.resume if not proxy._flowing.is_set() else proxy.stall)()
        print("stalled" if not proxy._flowing.is_set() else "flowing")
