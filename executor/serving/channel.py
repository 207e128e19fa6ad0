"""The local channel between API servers and the engine process (`serve --http`), as vLLM v1 has it: ZeroMQ sockets
over Unix-domain IPC, one msgpack frame a message. API servers PUSH requests into the engine's one PULL socket
(fan-in: `--api-server-count N` would add pushers); the engine PUSHes each API server's outputs to that server's own
PULL socket (index `client`). Sends never block: the high-water marks are off and every send is NOBLOCK, so the
engine's loop never waits on an API server.

Frames, as msgpack arrays:
- API server → engine: [ADD, client, rid, prompt_ids, max_tokens, arrival_s, temperature, top_p, seed, ignore_eos,
  min_tokens], [ABORT, rid, reason or None (None: finished, a stop string matched)], [SHUTDOWN].
- engine → API server: [[running, waiting, kv_usage, step_tokens, step_decode_rows], [[rid, new token ids,
  time, state, reason], ...]] once per turn with news; state RUNNING, FINISHED (reason: the finish reason) or
  REJECTED (reason: why).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgpack
import zmq

ADD, ABORT, SHUTDOWN = 0, 1, 2
RUNNING, FINISHED, REJECTED = 0, 1, 2
SERVER_STOPPED = "server stopped"  # the reject reason of requests still in the engine when it stops
ENGINE_DIED = "the engine process stopped"  # ... of requests in flight when the engine process dies


@dataclass(frozen=True)
class Addresses:
    """The IPC endpoints of one engine: its request socket and one output socket per API server."""

    requests: str
    outputs: tuple[str, ...]

    @classmethod
    def fresh(cls, api_servers: int = 1) -> Addresses:
        """Endpoints in a new private folder (Unix sockets, mode 0700: only this user reaches the engine)."""
        folder = Path(tempfile.mkdtemp(prefix="infersim-engine-"))
        os.chmod(folder, 0o700)
        return cls(f"ipc://{folder}/requests", tuple(f"ipc://{folder}/outputs-{i}" for i in range(api_servers)))

    @property
    def folder(self) -> Path:
        return Path(self.requests.removeprefix("ipc://")).parent


def pack(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes):
    return msgpack.unpackb(frame, raw=False)


def socket(context: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    """A socket that never blocks a send for want of a reader (no high-water mark), never lingers at close."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def send(sock: zmq.Socket, message) -> None:
    """One frame, without waiting (a peer that is gone drops it)."""
    try:
        sock.send(pack(message), zmq.NOBLOCK)
    except zmq.Again:
        pass  # nobody connected: the API server is gone, and the engine learns so from its parent's death
