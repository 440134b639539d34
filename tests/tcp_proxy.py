"""Test helper: a TCP proxy in front of a real service that a test can cut and restore, to take
the service away from a process under test (PostgreSQL going down mid-request) without touching
the service itself. Import as `tests.tcp_proxy`.

    with TcpProxy("127.0.0.5", upstream=("127.0.0.1", 5432)) as proxy:
        ... point the process at proxy.host:proxy.port ...
        proxy.cut()       # every open connection dropped, new ones refused
        proxy.restore()   # accepting again on the same port
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, host: str, *, upstream: tuple[str, int]):
        self.host = host
        self.upstream = upstream
        self.port = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.restore()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.cut()

    def restore(self) -> None:
        """Listen (again, on the same port) and forward every new connection upstream."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-proxy").start()

    def cut(self) -> None:
        """Stop listening (connections are refused) and drop every open connection."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        for sock in [listener, *sockets]:
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close()
                    server.close()
                    return
                self._sockets |= {client, server}
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
