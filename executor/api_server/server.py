"""`infersim serve --http`: the executor as an OpenAI-compatible server (Starlette on uvicorn), in two processes as
vLLM v1 has it. This one, the API server, does HTTP, JSON, the API key, tokenizing, detokenizing, server-sent events
and metrics; the engine process (executor.serving.online, started by executor.api_server.engine_client) runs the
engine core and nothing else, and the two talk over a Unix socket (executor.serving.channel). Every HTTP request joins the
engine's one continuous batch; tokens stream back as server-sent events, one chunk per engine step. A client that
goes away, or stops reading, has its request taken out and its KV freed at the next step. The front's bounds:
executor.api_server.limits."""
from __future__ import annotations

import asyncio
import hmac
import json
import signal
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from executor.api_server.detokenize import TextStream
from executor.api_server.engine_client import EngineClient, Pending, Update
from executor.api_server.limits import STALLED_KEY, ServerLimits, guarded_protocol
from executor.api_server.openai_protocol import (
    CLIENT_GONE,
    CLIENT_STALLED,
    Ask,
    BadRequest,
    chunk,
    error_body,
    models_body,
    new_id,
    parse_request,
    rejection,
    response,
    usage,
)
from executor.api_server.prometheus import ServerMetrics
from executor.serving.channel import REJECTED, SERVER_STOPPED

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OPEN_PATHS = frozenset({"/health", "/metrics"})  # open without the API key, as vLLM has them
INLINE_TOKENIZE_CHARS = 20_000  # longer prompts are tokenized on a thread: the event loop keeps serving the others


@dataclass
class Served:
    """What the server serves: the engine process's client, the model's tokenizer (None: prompts as token ids),
    its name, vocabulary, longest context and EOS token."""

    client: EngineClient
    tokenizer: object | None
    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None


class OpenAIServer:
    """The ASGI app (`app`) over an engine process connected and stopped with it. `on_fatal()` is called once the
    engine process has died (the runner stops serving then)."""

    def __init__(self, served: Served, limits: ServerLimits | None = None):
        self.served, self.limits = served, limits or ServerLimits()
        self.created = int(time.time())
        self.gauges = [0, 0, 0.0]
        self.metrics = ServerMetrics(served.model_name, lambda: tuple(self.gauges))
        self.max_prompt_chars = max_prompt_chars(served.tokenizer, served.max_model_len)
        client = served.client
        client.on_update, client.on_gauges, client.on_death = self._update, self._gauges, self._died
        self.on_fatal = lambda: None
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ], lifespan=self._lifespan, exception_handlers={404: self._not_found, 405: self._not_found})
        self.app = RequireKey(app, self.limits.api_key, self.metrics.request_refused) if self.limits.api_key else app

    @asynccontextmanager
    async def _lifespan(self, _app):
        self.loop = asyncio.get_running_loop()
        await self.served.client.start()
        try:
            yield
        finally:
            await self.served.client.stop()

    async def _not_found(self, request: HTTPRequest, exc) -> JSONResponse:
        status = getattr(exc, "status_code", 404)
        return JSONResponse(error_body(f"{request.method} {request.url.path}: no such route here", "not_found_error",
                                       None, status), status)

    # -- the engine's news and the server's state --------------------------------------------------------------
    def _update(self, p: Pending, u: Update) -> None:
        if u.ended:
            self.metrics.request_ended(p.prompt_len, p.token_times, p.arrival_s, u.reason,
                                       u.reason if u.state == REJECTED else None)

    def _gauges(self, gauges: list) -> None:
        self.gauges = gauges[:3]
        if gauges[3]:
            self.metrics.step_observed(gauges[3], gauges[4])

    def _died(self) -> None:
        self.on_fatal()

    def begin_shutdown(self) -> None:
        """Stop taking requests (503) and give those in flight ServerLimits.shutdown_timeout_s to finish before they
        are cancelled ("server stopped"). Any thread."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.loop.call_later(self.limits.shutdown_timeout_s, self._cancel_in_flight)

    def _cancel_in_flight(self) -> None:
        for p in list(self.served.client.pending.values()):
            self.served.client.abort(p, SERVER_STOPPED)

    def _check_open(self) -> None:
        error = self.served.client.error
        if error is not None or self.draining:
            raise BadRequest(error or "the server is shutting down", None, 503, "service_unavailable",
                             "service_unavailable")

    def _refuse(self, e: BadRequest) -> JSONResponse:
        """A request the front turns away before the engine sees it: counted, and answered."""
        self.metrics.request_refused(e.status)
        return JSONResponse(e.body(), e.status)  # a 413's unread body: discarded as it arrives, within request_timeout_s

    # -- routes ----------------------------------------------------------------------------------------------
    async def health(self, _request: HTTPRequest) -> Response:
        try:
            self._check_open()
        except BadRequest as e:
            return JSONResponse(e.body(), e.status)
        return Response(status_code=200)

    async def models(self, _request: HTTPRequest) -> JSONResponse:
        return JSONResponse(models_body(self.served.model_name, self.served.max_model_len, self.created))

    async def prometheus(self, _request: HTTPRequest) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.text(), media_type="text/plain; version=0.0.4")

    async def tokenize(self, request: HTTPRequest) -> Response:
        """vLLM's /tokenize: a prompt's (or chat's) token ids as the completions route would make them."""
        try:
            body = await read_json(request, self.limits.max_request_bytes)
            chat = isinstance(body, dict) and "messages" in body
            ask = parse_request({**body, "max_tokens": 1} if isinstance(body, dict) else body, chat,
                                self.served.model_name, self.served.vocab_size)
            ids = await self._prompt_ids(ask, body.get("add_special_tokens", True) is not False, bounded=False)
        except BadRequest as e:
            return self._refuse(e)
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse({"count": len(ids), "max_model_len": self.served.max_model_len, "tokens": ids})

    async def detokenize(self, request: HTTPRequest) -> Response:
        """vLLM's /detokenize: token ids back to text."""
        try:
            body = await read_json(request, self.limits.max_request_bytes)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < self.served.vocab_size
                                                       for t in tokens):
                raise BadRequest(f"tokens must be a list of token ids in 0..{self.served.vocab_size - 1}", "tokens")
        except BadRequest as e:
            return self._refuse(e)
        except ClientDisconnect:
            return Response(status_code=499)
        tok = self.served.tokenizer
        text = tok.decode(tokens) if tok is not None else " ".join(map(str, tokens))
        return JSONResponse({"prompt": text})

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: HTTPRequest, chat: bool) -> Response:
        client = self.served.client
        arrival = client.now()
        try:
            self._check_open()
            ask = parse_request(await read_json(request, self.limits.max_request_bytes), chat,
                                self.served.model_name, self.served.vocab_size)
            prompt_ids = await self._prompt_ids(ask)
        except BadRequest as e:
            return self._refuse(e)
        except ClientDisconnect:
            return Response(status_code=499)
        max_tokens = ask.max_tokens or max(1, self.served.max_model_len - len(prompt_ids))
        self.metrics.request_arrived()
        p = client.submit(prompt_ids, max_tokens, arrival, ask.temperature, ask.top_p, ask.seed, ask.ignore_eos,
                          ask.min_tokens)
        text = TextStream(self.served.tokenizer, prompt_ids, ask.stop)
        try:
            first = await _until_disconnect(request, p.queue.get())
        except ConnectionError:
            self._gone(p, request)
            return Response(status_code=499)
        if first.ended and first.state == REJECTED:
            e = rejection(first.reason)
            return JSONResponse(e.body(), e.status)
        rid = new_id(chat)
        if ask.stream:
            return StreamingResponse(self._events(request, p, text, first, rid, ask), headers=SSE_HEADERS,
                                     media_type="text/event-stream")
        try:
            body = await _until_disconnect(request, self._whole(p, text, first, rid, ask))
        except ConnectionError:
            self._gone(p, request)
            return Response(status_code=499)
        return JSONResponse(body[0], body[1])

    # -- one request -----------------------------------------------------------------------------------------
    async def _prompt_ids(self, ask: Ask, add_special_tokens: bool = True, bounded: bool = True) -> list[int]:
        """The prompt's token ids; with `bounded` (not /tokenize's), a prompt that cannot fit max_model_len is
        refused, before it is tokenized where its length alone says so."""
        served = self.served
        where = "messages" if ask.chat else "prompt"
        if isinstance(ask.prompt, list) and ask.prompt and isinstance(ask.prompt[0], int):
            return self._fits(ask.prompt, where) if bounded else ask.prompt
        tok = served.tokenizer
        if tok is None:
            raise BadRequest(f"{served.model_name} has no tokenizer here: send the prompt as token ids", "prompt")
        chars = sum(len(m["content"]) for m in ask.prompt) if ask.chat else len(ask.prompt)
        if bounded and chars > self.max_prompt_chars:
            raise BadRequest(f"the prompt has {chars} characters: more than max_model_len ({served.max_model_len}) "
                             f"tokens can hold here (at most {self.max_prompt_chars})", where)
        if ask.chat:
            if not getattr(tok, "chat_template", None):
                raise BadRequest(f"{served.model_name}'s tokenizer has no chat template: use /v1/completions",
                                 "messages")
            text = tok.apply_chat_template(ask.prompt, add_generation_prompt=True, tokenize=False)
            special = False
        else:
            text, special = ask.prompt, add_special_tokens
        if len(text) <= INLINE_TOKENIZE_CHARS:
            ids = tok.encode(text, add_special_tokens=special)
        else:
            ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=special)
        if not ids:
            raise BadRequest("the prompt is empty once tokenized", where)
        return self._fits(ids, where) if bounded else ids

    def _fits(self, ids: list[int], where: str) -> list[int]:
        if len(ids) >= self.served.max_model_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens: max_model_len ({self.served.max_model_len}) leaves "
                             "no room for an output token", where)
        return ids

    def _gone(self, p: Pending, request: HTTPRequest) -> None:
        """Its client went away (or stopped reading): out of the batch at the next step."""
        self.served.client.abort(p, CLIENT_STALLED if request.scope.get(STALLED_KEY) else CLIENT_GONE)

    def _finish_reason(self, update: Update, text: TextStream) -> str:
        if text.stopped:
            return "stop"
        return (update.reason if update.ended and update.state != REJECTED else None) or "length"

    def _stop_early(self, p: Pending, text: TextStream) -> None:
        """A stop string matched: the request ends there, finished."""
        if text.stopped:
            self.served.client.abort(p, None)

    async def _events(self, request: HTTPRequest, p: Pending, text: TextStream, first: Update, rid: str, ask: Ask):
        """The server-sent events of a streamed request: a chunk per engine step, the finish reason (and usage) on
        the last, then [DONE]."""
        model, created, chat = self.served.model_name, self.created, ask.chat
        update, sent, role, finished = first, 0, chat, False
        try:
            while True:
                sent += len(update.tokens)
                delta = text.add(update.tokens, update.ended)
                self._stop_early(p, text)
                done = update.ended or text.stopped
                if done and update.state == REJECTED and not text.stopped:
                    finished = True
                    yield _sse(error_body(f"the request ended early: {update.reason}", "server_error"))
                    break
                if update.tokens or done:
                    body = chunk(rid, chat, model, created, delta, self._finish_reason(update, text) if done else None,
                                 role)
                    role = False
                    if done and not ask.include_usage:
                        body["usage"] = usage(p.prompt_len, sent)
                    yield _sse(body)
                if done:
                    finished = True
                    if ask.include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": created, "model": model, "choices": [],
                                    "usage": usage(p.prompt_len, sent)})
                    break
                update = await p.queue.get()
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self._gone(p, request)

    async def _whole(self, p: Pending, text: TextStream, first: Update, rid: str, ask: Ask) -> tuple[dict, int]:
        """A request answered in one body once it ends."""
        update, sent = first, 0
        while True:
            sent += len(update.tokens)
            text.add(update.tokens, update.ended)
            self._stop_early(p, text)
            if update.ended or text.stopped:
                break
            update = await p.queue.get()
        if update.state == REJECTED and not text.stopped:
            e = rejection(update.reason)
            return e.body(), e.status
        return response(rid, ask.chat, self.served.model_name, self.created, text.text,
                        self._finish_reason(update, text), usage(p.prompt_len, sent)), 200


class RequireKey:
    """ASGI middleware: every route but OPEN_PATHS needs `Authorization: Bearer KEY` (OpenAI's header); 401
    otherwise."""

    def __init__(self, app, key: str, refused=lambda status: None):
        self.app, self.expected, self.refused = app, f"Bearer {key}".encode(), refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = error_body("a valid API key is needed: send the header Authorization: Bearer KEY",
                          "authentication_error", None, "invalid_api_key")
        self.refused(401)
        await JSONResponse(body, 401, headers={"www-authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The most characters a text prompt of max_model_len tokens can have: every token its vocabulary's longest
    and a separator (a tokenizer without a vocabulary to read: no bound)."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return 1 << 62
    return max_model_len * (max(map(len, vocab()), default=1) + 1)


async def read_json(request: HTTPRequest, limit: int):
    """The request's JSON body, read no further than `limit` bytes (413 past it, 400 for what is not JSON: NaN and
    Infinity included, nesting Python cannot parse included)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise BadRequest(f"the request body is larger than {limit} bytes", None, 413, "invalid_request_error",
                         "request_too_large")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BadRequest(f"the request body is larger than {limit} bytes", None, 413, "invalid_request_error",
                             "request_too_large")
        chunks.append(part)
    try:
        return json.loads(b"".join(chunks), parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("the request body nests deeper than this server parses") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({str(e)[:80]})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


async def _until_disconnect(request: HTTPRequest, work):
    """`work` awaited unless the client disconnects first (ConnectionError then; the work is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    raise ConnectionError("client disconnected")


async def _disconnected(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: one the system picks), before the server starts: its address is known at once."""
    # proto named: asyncio turns Nagle off only on sockets whose proto says TCP, and accepted ones inherit this one's
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class HTTPServer(uvicorn.Server):
    """uvicorn serving an OpenAIServer within its limits. SIGTERM or Ctrl-C drains it (a second Ctrl-C: now) and
    `run` returns instead of re-raising the signal; the engine process dying stops it (`api.served.client.error`
    says why)."""

    def __init__(self, api: OpenAIServer):
        limits = api.limits
        super().__init__(uvicorn.Config(api.app, log_level="warning", lifespan="on", http=guarded_protocol(limits),
                                        limit_concurrency=limits.max_connections,
                                        timeout_graceful_shutdown=limits.shutdown_timeout_s + 5))
        self.api = api
        api.on_fatal = self.stop

    def stop(self) -> None:
        """Drain and stop (any thread)."""
        self.api.begin_shutdown()
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.stop()


class Running:
    """A server on its own thread (tests, benches): `url`, then `stop()`."""

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0):
        self.server = server
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.uvicorn = HTTPServer(server)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.uvicorn.started and self.thread.is_alive():
            time.sleep(0.01)

    def stop(self) -> None:
        self.uvicorn.stop()
        self.thread.join(timeout=self.server.limits.shutdown_timeout_s + 30)
        self.sock.close()
