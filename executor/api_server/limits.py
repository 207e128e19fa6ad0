"""What the HTTP front allows a client, and the connection-level guards that enforce it: a deadline to send a
request (headers and body) and a deadline for a stream its client stops reading, on uvicorn's h11 protocol; a
bounded kernel send buffer per connection, so a client that stops reading holds a bounded amount of memory."""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

# scope key the stall guard sets before it drops a connection: the handler then ends its request with CLIENT_STALLED
STALLED_KEY = "infersim.stalled"


@dataclass(frozen=True)
class ServerLimits:
    """The HTTP front's bounds (docs/endpoints.md#limits). `api_key`: clients must send `Authorization: Bearer
    KEY` (None: no key); `max_request_bytes`: a larger body gets 413 unread; `max_connections`: past it a request
    gets 503 (uvicorn's limit_concurrency); `request_timeout_s`: a connection that has not sent a whole request
    (headers and body) this long after it opened, or after its last response, is closed (408 if it began one);
    `stall_timeout_s`: a response its client has read nothing of for this long is dropped and its request ended
    (KV freed); `shutdown_timeout_s`: on SIGTERM, requests in flight get this long to finish before they are
    cancelled ("server stopped"); `send_buffer_bytes`: the kernel's send buffer per connection, and what the
    server holds unsent for one before its response waits."""

    api_key: str | None = None
    max_request_bytes: int = 4 << 20
    max_connections: int = 1024
    request_timeout_s: float = 30.0
    stall_timeout_s: float = 30.0
    shutdown_timeout_s: float = 30.0
    send_buffer_bytes: int = 256 << 10


def _timeout_response() -> bytes:
    body = json.dumps({"error": {"message": "the request was not sent in time", "type": "invalid_request_error",
                                 "param": None, "code": 408}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


TIMEOUT_RESPONSE = _timeout_response()


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the request deadline, the stall deadline and the send buffer of its `limits`
    (a subclass per server sets them: guarded_protocol)."""

    limits = ServerLimits()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
        transport.set_write_buffer_limits(high=self.limits.send_buffer_bytes)  # unsent bytes it may hold, as the kernel
        self.read_timer = self.stall_timer = None
        self._arm_read()

    def _arm_read(self) -> None:
        """The next request must arrive whole within request_timeout_s."""
        if self.read_timer is not None:
            self.read_timer.cancel()
        self.armed_cycle = self.cycle
        self.read_timer = self.loop.call_later(self.limits.request_timeout_s, self._read_expired)

    def _read_expired(self) -> None:
        self.read_timer = None
        cycle = self.cycle
        if self.transport.is_closing():
            return
        if cycle is self.armed_cycle or (cycle.more_body and not cycle.response_started):
            if cycle is not self.armed_cycle:  # a request begun and not finished: say why it ends
                self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.stall_timer is None:
            self.stall_timer = self.loop.call_later(self.limits.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None

    def _stalled(self) -> None:
        """The client read nothing for stall_timeout_s: drop the connection (its handler ends the request)."""
        self.stall_timer = None
        if self.cycle is not None:
            self.cycle.scope[STALLED_KEY] = True
        self.transport.abort()

    def connection_lost(self, exc) -> None:
        for timer in (self.read_timer, self.stall_timer):
            if timer is not None:
                timer.cancel()
        self.read_timer = self.stall_timer = None
        super().connection_lost(exc)


def guarded_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the request deadline, the stall deadline and the send buffer of `limits`."""
    return type("GuardedH11", (GuardedH11,), {"limits": limits})
