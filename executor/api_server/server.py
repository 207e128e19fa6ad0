"""`infersim serve --http`: the executor as an OpenAI-compatible server (Starlette on uvicorn). Every HTTP request
joins the one continuous batch the engine thread runs (executor.serving.online); tokens stream back as server-sent events,
one chunk per engine step. A client that goes away has its request taken out, and its KV freed, at the next step."""
from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from executor.api_server.detokenize import TextStream
from executor.api_server.openai_protocol import (
    CLIENT_GONE,
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
from executor.core.engine import Engine
from executor.model.sampling import RequestSampling, SamplingParams
from executor.serving.online import OnlineEngine, Stream
from sim.policy.request import Request, Status

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Served:
    """What the server serves: the engine, the model's tokenizer (None: prompts as token ids), its name, vocabulary,
    longest context and EOS token."""

    engine: Engine
    tokenizer: object | None
    model_name: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None


class OpenAIServer:
    """The ASGI app (`app`) over an OnlineEngine started and stopped with it."""

    def __init__(self, served: Served, keep_warm_s: float = 0.0, keep_trace: bool = False,
                 adapt_threads: bool = False):
        self.served = served
        self.ids = itertools.count()
        self.created = int(time.time())
        sched = served.engine.scheduler
        self.metrics = ServerMetrics(served.model_name, lambda: (
            len(sched.running), len(sched.waiting), sched.kv.num_used / max(1, sched.kv.num_blocks)))
        self.online = OnlineEngine(served.engine, self._dispatch, keep_warm_s, self._ended, keep_trace, adapt_threads)
        self.queues: dict[Stream, asyncio.Queue] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ], lifespan=self._lifespan, exception_handlers={404: self._not_found, 405: self._not_found})

    @asynccontextmanager
    async def _lifespan(self, _app):
        self.loop = asyncio.get_running_loop()
        self.online.engine.t0 = time.perf_counter()
        self.online.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.online.stop)

    async def _not_found(self, request: HTTPRequest, exc) -> JSONResponse:
        status = getattr(exc, "status_code", 404)
        return JSONResponse(error_body(f"{request.method} {request.url.path}: no such route here", "not_found_error",
                                       None, status), status)

    # -- the engine's news, on the event loop -----------------------------------------------------------------
    def _dispatch(self, updates) -> None:
        """From the engine thread, after a step: every stream's news to its handler, in one hop."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._deliver, updates)

    def _deliver(self, updates) -> None:
        for stream, tokens, at, ended in updates:
            queue = self.queues.get(stream)
            if queue is not None:
                queue.put_nowait((tokens, at, ended))

    def _ended(self, stream: Stream) -> None:
        r = stream.request
        self.metrics.request_ended(r.prompt_len, r.token_times, r.arrival_s, r.finish_reason,
                                   r.reject_reason if r.status is Status.REJECTED else None)

    # -- routes ----------------------------------------------------------------------------------------------
    async def health(self, _request: HTTPRequest) -> Response:
        if self.online.error is not None:
            return JSONResponse(error_body(f"the engine stopped: {self.online.error}", "server_error"), 503)
        return Response(status_code=200)

    async def models(self, _request: HTTPRequest) -> JSONResponse:
        return JSONResponse(models_body(self.served.model_name, self.served.max_model_len, self.created))

    async def prometheus(self, _request: HTTPRequest) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.text(), media_type="text/plain; version=0.0.4")

    async def tokenize(self, request: HTTPRequest) -> JSONResponse:
        """vLLM's /tokenize: a prompt's (or chat's) token ids as the completions route would make them."""
        try:
            body = await _json(request)
            chat = isinstance(body, dict) and "messages" in body
            ask = parse_request({**body, "max_tokens": 1} if isinstance(body, dict) else body, chat,
                                self.served.model_name, self.served.vocab_size)
            ids = self._prompt_ids(ask, add_special_tokens=body.get("add_special_tokens", True) is not False)
        except BadRequest as e:
            return JSONResponse(e.body(), e.status)
        return JSONResponse({"count": len(ids), "max_model_len": self.served.max_model_len, "tokens": ids})

    async def detokenize(self, request: HTTPRequest) -> JSONResponse:
        """vLLM's /detokenize: token ids back to text."""
        try:
            body = await _json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < self.served.vocab_size
                                                       for t in tokens):
                raise BadRequest(f"tokens must be a list of token ids in 0..{self.served.vocab_size - 1}", "tokens")
        except BadRequest as e:
            return JSONResponse(e.body(), e.status)
        tok = self.served.tokenizer
        text = tok.decode(tokens) if tok is not None else " ".join(map(str, tokens))
        return JSONResponse({"prompt": text})

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: HTTPRequest, chat: bool) -> Response:
        arrival = self.online.now()
        try:
            if self.online.error is not None:
                raise BadRequest(f"the engine stopped: {self.online.error}", None, 503, "service_unavailable")
            ask = parse_request(await _json(request), chat, self.served.model_name, self.served.vocab_size)
            prompt_ids = self._prompt_ids(ask)
        except BadRequest as e:
            return JSONResponse(e.body(), e.status)
        max_tokens = ask.max_tokens or max(1, self.served.max_model_len - len(prompt_ids))
        req = Request(next(self.ids), arrival, len(prompt_ids), max_tokens)
        stream = Stream(req, prompt_ids, self._sampling(ask))
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[stream] = queue
        self.metrics.request_arrived()
        self.online.submit(stream)
        text = TextStream(self.served.tokenizer, prompt_ids, ask.stop)
        try:
            first = await _until_disconnect(request, queue.get())
        except ConnectionError:
            self._gone(stream)
            return Response(status_code=499)
        tokens, _, ended = first
        if ended and req.status is Status.REJECTED:
            self.queues.pop(stream, None)
            e = rejection(req.reject_reason)
            return JSONResponse(e.body(), e.status)
        rid = new_id(chat)
        if ask.stream:
            return StreamingResponse(self._events(stream, queue, text, first, rid, ask), headers=SSE_HEADERS,
                                     media_type="text/event-stream")
        try:
            body = await _until_disconnect(request, self._whole(stream, queue, text, first, rid, ask))
        except ConnectionError:
            self._gone(stream)
            return Response(status_code=499)
        return JSONResponse(body[0], body[1])

    # -- one request -----------------------------------------------------------------------------------------
    def _prompt_ids(self, ask: Ask, add_special_tokens: bool = True) -> list[int]:
        tok = self.served.tokenizer
        if isinstance(ask.prompt, list) and ask.prompt and isinstance(ask.prompt[0], int):
            return ask.prompt
        if tok is None:
            raise BadRequest(f"{self.served.model_name} has no tokenizer here: send the prompt as token ids", "prompt")
        if ask.chat:
            if not getattr(tok, "chat_template", None):
                raise BadRequest(f"{self.served.model_name}'s tokenizer has no chat template: use /v1/completions",
                                 "messages")
            text = tok.apply_chat_template(ask.prompt, add_generation_prompt=True, tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(ask.prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise BadRequest("the prompt is empty once tokenized", "messages" if ask.chat else "prompt")
        return ids

    def _sampling(self, ask: Ask) -> RequestSampling:
        generator = None
        if ask.temperature > 0:
            generator = torch.Generator(device=self.served.engine.device)
            if ask.seed is not None:
                generator.manual_seed(ask.seed % 2**63)
            else:
                generator.seed()
        params = SamplingParams(ask.temperature, ask.top_p, 0, 0, ask.ignore_eos)
        return RequestSampling(params, generator, ask.min_tokens)

    def _gone(self, stream: Stream) -> None:
        """Its client went away: out of the batch at the next step."""
        self.queues.pop(stream, None)
        if not stream.request.is_done:
            self.online.abort(stream, CLIENT_GONE)

    def _finish_reason(self, stream: Stream, text: TextStream) -> str:
        if text.stopped:
            return "stop"
        return stream.request.finish_reason or "length"

    def _stop_early(self, stream: Stream, text: TextStream) -> None:
        """A stop string matched: the request ends there, finished."""
        if text.stopped and not stream.request.is_done:
            self.online.abort(stream, None)

    async def _events(self, stream: Stream, queue: asyncio.Queue, text: TextStream, first, rid: str, ask: Ask):
        """The server-sent events of a streamed request: a chunk per engine step, the finish reason (and usage) on
        the last, then [DONE]."""
        model, created, chat, req = self.served.model_name, self.created, ask.chat, stream.request
        update, sent, role = first, 0, chat
        try:
            while True:
                tokens, _, ended = update
                sent += len(tokens)
                delta = text.add(tokens, ended)
                self._stop_early(stream, text)
                done = ended or text.stopped
                if done and req.status is Status.REJECTED and not text.stopped:
                    yield _sse(error_body(f"the request ended early: {req.reject_reason}", "server_error"))
                    break
                if tokens or done:
                    body = chunk(rid, chat, model, created, delta, self._finish_reason(stream, text) if done else None,
                                 role)
                    role = False
                    if done and not ask.include_usage:
                        body["usage"] = usage(req.prompt_len, sent)
                    yield _sse(body)
                if done:
                    if ask.include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": created, "model": model, "choices": [],
                                    "usage": usage(req.prompt_len, sent)})
                    break
                update = await queue.get()
            yield "data: [DONE]\n\n"
        finally:
            if not req.is_done and not text.stopped:
                self._gone(stream)
            self.queues.pop(stream, None)

    async def _whole(self, stream: Stream, queue: asyncio.Queue, text: TextStream, first, rid: str,
                     ask: Ask) -> tuple[dict, int]:
        """A request answered in one body once it ends."""
        update, sent, req = first, 0, stream.request
        while True:
            tokens, _, ended = update
            sent += len(tokens)
            text.add(tokens, ended)
            self._stop_early(stream, text)
            if ended or text.stopped:
                break
            update = await queue.get()
        self.queues.pop(stream, None)
        if req.status is Status.REJECTED and not text.stopped:
            e = rejection(req.reject_reason)
            return e.body(), e.status
        return response(rid, ask.chat, self.served.model_name, self.created, text.text,
                        self._finish_reason(stream, text), usage(req.prompt_len, sent)), 200


async def _json(request: HTTPRequest):
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None


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


class Running:
    """A server on its own thread (tests, benches): `url`, then `stop()`."""

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = server
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="on",
                                                     timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.uvicorn.started and self.thread.is_alive():
            time.sleep(0.01)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
