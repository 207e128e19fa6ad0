"""The local channel between API servers and the engine process (`serve --http`): one Unix-domain stream socket per
API server, in a private folder, carrying length-prefixed msgpack frames both ways. The engine listens; each API
server connects once (`--api-server-count N` would be N connections) and gets the outputs of its own requests back on
the same connection. The engine reads and writes without blocking, from its loop's thread — one system call a
message, no I/O thread to wake (a ZeroMQ context's I/O thread, woken per message, took the engine's core for
milliseconds a step when the two shared it) — and keeps what a socket cannot take yet until the next turn, so its
loop never waits on an API server.

Frames, as msgpack arrays:
- API server → engine: [ADD, id, prompt_ids, max_tokens, arrival_s, temperature, top_p, seed, ignore_eos,
  min_tokens], [ABORT, id, reason or None (None: finished, a stop string matched)], [SHUTDOWN].
- engine → API server: [[running, waiting, kv_usage, step_tokens, step_decode_rows], [[id, new token ids, time,
  state, reason], ...]] once per turn with news; state RUNNING, FINISHED (reason: the finish reason) or REJECTED
  (reason: why).
"""
from __future__ import annotations

import os
import socket
import struct
import tempfile
from pathlib import Path

import msgpack

ADD, ABORT, SHUTDOWN = 0, 1, 2
RUNNING, FINISHED, REJECTED = 0, 1, 2
SERVER_STOPPED = "server stopped"  # the reject reason of requests still in the engine when it stops
ENGINE_DIED = "the engine process stopped"  # ... of requests in flight when the engine process dies
HEADER = struct.Struct("!I")  # a frame's length, before it
READ_BYTES = 1 << 16


def fresh_address() -> str:
    """A socket path in a new private folder (mode 0700: only this user reaches the engine)."""
    folder = Path(tempfile.mkdtemp(prefix="infersim-engine-"))
    os.chmod(folder, 0o700)
    return str(folder / "engine.sock")


def frame(message) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unframe(body: bytes):
    return msgpack.unpackb(body, raw=False)


class Frames:
    """Bytes as they arrive → the whole messages among them."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list:
        self.buffer += data
        out, at = [], 0
        while len(self.buffer) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buffer, at)
            if len(self.buffer) - at - HEADER.size < n:
                break
            out.append(unframe(bytes(self.buffer[at + HEADER.size:at + HEADER.size + n])))
            at += HEADER.size + n
        del self.buffer[:at]
        return out


class Peer:
    """One API server's connection on the engine's side, non-blocking: `receive()` the messages that came, `send()`
    one (what the socket cannot take yet waits in `unsent` for the next `flush`). `closed` once it hung up."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock, self.frames, self.unsent, self.closed = sock, Frames(), bytearray(), False

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list:
        out = []
        while not self.closed:
            try:
                data = self.sock.recv(READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            out += self.frames.feed(data)
        return out

    def send(self, message) -> None:
        self.unsent += frame(message)
        self.flush()

    def flush(self) -> None:
        if not self.unsent or self.closed:
            return
        try:
            sent = self.sock.send(self.unsent)
        except BlockingIOError:
            return
        except OSError:
            self.closed = True
            return
        del self.unsent[:sent]

    def close(self, linger_s: float = 5.0) -> None:
        """Hang up once what is unsent has gone (waiting up to `linger_s`: the engine is stopping)."""
        if self.unsent and not self.closed:
            try:
                self.sock.settimeout(linger_s)
                self.sock.sendall(self.unsent)
            except OSError:
                pass
        self.closed = True
        self.sock.close()


def listen(path: str) -> socket.socket:
    """The engine's listening socket at `path` (non-blocking)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(16)
    sock.setblocking(False)
    return sock
