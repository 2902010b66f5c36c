"""A small loopback TCP proxy that a test can cut, restore and ambush.

It sits between the registry and PostgreSQL, so a test can take the database
link away (and give it back) without touching the shared server:
- `cut()`: every open connection is reset (RST) and new ones are accepted and
  reset at once, as when the database host goes down;
- `restore()`: new connections are forwarded again;
- `lose_reply_to(marker)`: the next client->server chunk containing `marker`
  (e.g. b"COMMIT") is delivered to the server, the server's answer is swallowed
  and the connection reset: the statement ran, the client never heard so.

Loopback only and bounded (at most `max_connections` at once; threads are daemons
and `close()` joins them), so a failing test cannot leak a busy proxy.
"""

from __future__ import annotations

import socket
import struct
import threading

_CHUNK = 64 * 1024


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees a broken connection, not an orderly end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # close() alone does not wake a thread blocked in recv() on this socket;
        # SHUT_RD does (recv returns b""), and sends nothing to the peer.
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket):
        self.client = client
        self.server = server
        self.swallow_replies = threading.Event()   # set: server->client bytes are dropped
        self.ambush: bytes | None = None           # the marker whose statement this pair carried
        self.reply_swallowed = threading.Event()   # set once a swallowed reply arrived
        self.closed = False
        self.lock = threading.Lock()

    def reset(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        _reset(self.client)
        _reset(self.server)


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, *, max_connections: int = 64):
        if target_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the fault proxy forwards to loopback only, not {target_host!r}")
        self.target = (target_host, target_port)
        self.max_connections = max_connections
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: set[_Pair] = set()
        self._threads: list[threading.Thread] = []
        self._up = True
        self._flowing = threading.Event()           # cleared: a partition, nothing moves
        self._flowing.set()
        self._held: list[socket.socket] = []        # connections accepted during a partition
        self._closing = False
        self._ambush: bytes | None = None
        self.ambushed = threading.Event()           # set when an ambushed reply was swallowed
        self.accepted = 0
        self.refused = 0
        self._acceptor = threading.Thread(target=self._accept_loop, name="fault-proxy-accept", daemon=True)
        self._acceptor.start()

    # --- control -------------------------------------------------------------------

    def cut(self) -> None:
        """Database down: reset every open connection and every new one."""
        with self._lock:
            self._up = False
            pairs = list(self._pairs)
            held, self._held = self._held, []
        for p in pairs:
            p.reset()
        for client in held:
            _reset(client)
        self._flowing.set()   # a reset is news that gets through a partition

    def partition(self) -> None:
        """Network partition: open connections stay open but nothing moves either way, new
        ones are accepted and never answered. No RST, no FIN: only a timeout can tell.
        Bytes are not lost: TCP holds them, and they flow again on `restore()`."""
        with self._lock:
            self._flowing.clear()

    def restore(self) -> None:
        with self._lock:
            self._up = True
            held, self._held = self._held, []
            self._flowing.set()
        for client in held:
            self._connect(client)

    def lose_reply_to(self, marker: bytes) -> None:
        """Arm the ambush for the next client chunk containing `marker` (once)."""
        with self._lock:
            self._ambush = marker
            self.ambushed.clear()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            pairs = list(self._pairs)
            held, self._held = self._held, []
        for s in held:
            _reset(s)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        for p in pairs:
            p.reset()
        self._flowing.set()
        self._acceptor.join(timeout=5)
        for t in list(self._threads):
            t.join(timeout=5)

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing ------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return   # listener closed
            with self._lock:
                if self._closing:
                    _reset(client)
                    return
                if not self._flowing.is_set() and len(self._held) < self.max_connections:
                    self._held.append(client)
                    continue
                admit = self._up and len(self._pairs) < self.max_connections
            if not admit:
                self.refused += 1
                _reset(client)
                continue
            self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.target, timeout=5)
            server.settimeout(None)
        except OSError:
            self.refused += 1
            _reset(client)
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, server)
        with self._lock:
            self._pairs.add(pair)
            self.accepted += 1
            self._threads = [t for t in self._threads if t.is_alive()]
            for direction in ("up", "down"):
                t = threading.Thread(target=self._pump, args=(pair, direction), daemon=True,
                                     name=f"fault-proxy-{direction}")
                self._threads.append(t)
                t.start()

    def _pump(self, pair: _Pair, direction: str) -> None:
        src, dst = (pair.client, pair.server) if direction == "up" else (pair.server, pair.client)
        try:
            while True:
                self._flowing.wait()   # a partition: stop reading, TCP flow control holds the rest
                data = src.recv(_CHUNK)
                if not data:
                    break
                self._flowing.wait()
                if direction == "up":
                    with self._lock:
                        hit = self._ambush is not None and self._ambush in data
                        if hit:
                            pair.ambush, self._ambush = self._ambush, None
                    if hit:
                        # Deliver the statement, then drop whatever the server answers.
                        pair.swallow_replies.set()
                    dst.sendall(data)
                else:
                    if pair.swallow_replies.is_set():
                        # The server answered the ambushed statement: it ran. The
                        # client must never learn it, so reset instead of forwarding.
                        self.ambushed.set()
                        break
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                if pair.ambush is not None and not self.ambushed.is_set():
                    # The pair ended without the server answering the ambushed statement (its
                    # backend was terminated just before, or the statement never reached it):
                    # nothing was swallowed, so the ambush stays armed for the next statement.
                    if self._ambush is None:
                        self._ambush = pair.ambush
                    pair.ambush = None
            pair.reset()
            with self._lock:
                self._pairs.discard(pair)
