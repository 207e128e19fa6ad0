"""Replaying a scenario's workload against any OpenAI-compatible endpoint (vLLM, TGI, SGLang, llama.cpp's server,
`infersim serve --http`), streaming, and timing each request as vLLM's serving benchmark does: TTFT from sending to
the first streamed chunk, ITL every gap between chunks, E2E sending to the last.

The arrivals are the scenario's, through the same arrival book as the simulator's (sim.policy.arrivals: conversations,
closed loops, max_concurrency). Prompts are text of exactly the scenario's prompt lengths as the endpoint counts
them (its own /tokenize, or a local tokenizer), checked against the `usage` it answers with; outputs are forced to
the scenario's lengths with `ignore_eos` and `min_tokens` where the server takes them. A request the endpoint
refuses, drops or cuts short ends rejected with the reason; none is lost.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from importlib.resources import files

import httpx

from sim.config.errors import ConfigError
from sim.config.workload import RequestSpec
from sim.policy.conversation import CONVERSATION_ENDED
from sim.policy.request import Request, Status
from sim.policy.stages import arrival_book

CORPUS = "declaration_of_independence.txt"  # the text the executor's prompts are cut from (executor/core/prompts.py)
CONNECT_TIMEOUT_S = 10.0
ADJUST_TRIES = 8  # rounds of cutting or growing a prompt's text to its token count


def base_url(url: str) -> str:
    """The server's root: "http://host:8000/v1" and "http://host:8000/" both give "http://host:8000"."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{url!r} is not an http(s) URL; allowed: e.g. http://localhost:8000/v1", "--endpoint")
    return url[:-3] if url.endswith("/v1") else url


class RemoteTokens:
    """The endpoint's own tokenizer: vLLM's (and infersim's) /tokenize and /detokenize, llama-cpp-python's
    /extras/tokenize, or llama.cpp's /tokenize with `content`."""

    FORMS = {
        "vllm": ("/tokenize", lambda text, m: {"model": m, "prompt": text, "add_special_tokens": False},
                 "/detokenize", lambda ids, m: {"model": m, "tokens": ids}, "prompt"),
        "llama-cpp-python": ("/extras/tokenize", lambda text, m: {"input": text, "model": m},
                             "/extras/detokenize", lambda ids, m: {"tokens": ids, "model": m}, "text"),
        "llama.cpp": ("/tokenize", lambda text, m: {"content": text, "add_special": False},
                      "/detokenize", lambda ids, m: {"tokens": ids}, "content"),
    }

    def __init__(self, client: httpx.Client, model: str, form: str):
        self.client, self.model, self.form = client, model, form
        self.where = f"{form}'s /tokenize"

    @classmethod
    def probe(cls, client: httpx.Client, model: str) -> RemoteTokens | None:
        """The first tokenizer form the endpoint answers, or None."""
        for form in cls.FORMS:
            tokens = cls(client, model, form)
            try:
                if tokens.encode("Hello world, once more") and tokens.decode(tokens.encode("Hello")).strip():
                    return tokens
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                continue
        return None

    def encode(self, text: str) -> list[int]:
        path, body, *_ = self.FORMS[self.form]
        r = self.client.post(path, json=body(text, self.model))
        r.raise_for_status()
        ids = r.json()["tokens"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("tokens is not a list of token ids")
        return ids

    def decode(self, ids: list[int]) -> str:
        _, _, path, body, key = self.FORMS[self.form]
        r = self.client.post(path, json=body(ids, self.model))
        r.raise_for_status()
        return r.json()[key]


class LocalTokens:
    """A local Hugging Face tokenizer (a folder, or a GGUF file as the executor reads one) for an endpoint that
    exposes none."""

    def __init__(self, path: str):
        from pathlib import Path

        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("a local tokenizer needs transformers: pip install 'infersim[executor]'",
                              "--tokenizer") from None
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"{path}: no such tokenizer folder or GGUF file", "--tokenizer")
        try:
            if p.suffix == ".gguf":
                self.hf = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
            else:
                self.hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load a tokenizer from {path} ({type(e).__name__})", "--tokenizer") from None
        self.where = f"the local tokenizer {path}"

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)


@dataclass
class Endpoint:
    """An OpenAI-compatible server: its root URL, the model it serves, what it says it is, its tokenizer, and how
    many tokens it adds to a text prompt (a BOS token: measured from its `usage`)."""

    url: str
    model: str
    engine: str
    tokens: RemoteTokens | LocalTokens
    client: httpx.Client
    added_tokens: int = 0
    max_model_len: int | None = None

    def describe(self) -> dict:
        return {"url": self.url, "model": self.model, "engine": self.engine, "tokenizer": self.tokens.where,
                "added_tokens": self.added_tokens, "max_model_len": self.max_model_len}

    def close(self) -> None:
        self.client.close()


def connect(url: str, served_model: str | None = None, tokenizer: str | None = None) -> Endpoint:
    """Find the endpoint's model (/v1/models: the one it serves, or `served_model`), its tokenizer (its own, else
    `tokenizer`), and what it adds to a text prompt; a one-line error for what is missing."""
    root = base_url(url)
    client = httpx.Client(base_url=root, timeout=httpx.Timeout(60.0, connect=CONNECT_TIMEOUT_S))
    try:
        r = client.get("/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        names = [m.get("id") for m in data if isinstance(m, dict)]
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        client.close()
        raise ConfigError(f"{root}/v1/models did not answer as an OpenAI-compatible server does "
                          f"({type(e).__name__}: {str(e)[:80]})", "--endpoint") from None
    if served_model is None and len(names) != 1:
        client.close()
        raise ConfigError(f"{root} serves {len(names)} models ({', '.join(map(str, names[:4]))}); name one with "
                          "--served-model", "--served-model")
    model = served_model or names[0]
    if model not in names:
        client.close()
        raise ConfigError(f"{root} does not serve {model!r}; it serves {', '.join(map(str, names[:4]))}",
                          "--served-model")
    card = data[names.index(model)]
    # what the server says of itself: its `server` header and the model's owner (vLLM: "vllm"; llama.cpp's: "me")
    said = [f"server {r.headers['server']}" if r.headers.get("server") else "",
            f"owned_by {str(card['owned_by'])[:40]}" if card.get("owned_by") else ""]
    engine = ", ".join(x for x in said if x) or "unknown"
    tokens = LocalTokens(tokenizer) if tokenizer else RemoteTokens.probe(client, model)
    if tokens is None:
        client.close()
        raise ConfigError(f"{root} exposes no tokenizer (/tokenize, /extras/tokenize); give a local one with "
                          "--tokenizer PATH (a Hugging Face folder or a GGUF file)", "--tokenizer")
    ep = Endpoint(root, model, engine, tokens, client, max_model_len=card.get("max_model_len"))
    ep.added_tokens = _added_tokens(ep)
    return ep


def _added_tokens(ep: Endpoint) -> int:
    """How many tokens the server counts beyond a text prompt's own (a BOS it adds): one request of one token."""
    text = ep.tokens.decode(ep.tokens.encode(corpus_text())[:8])
    own = len(ep.tokens.encode(text))
    try:
        r = ep.client.post("/v1/completions", json={"model": ep.model, "prompt": text, "max_tokens": 1,
                                                    "temperature": 0})
        r.raise_for_status()
        served = r.json()["usage"]["prompt_tokens"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return 0  # no usage to learn it from: prompts are sized by the tokenizer alone
    return max(0, int(served) - own)


def corpus_text() -> str:
    return (files("executor") / "data" / CORPUS).read_text()


class Prompts:
    """Prompt text of an exact token count as the endpoint counts it: a window of the shipped corpus (where it
    starts depends on the request, as the executor's prompts), cut or grown until the endpoint's tokenizer counts
    the wanted number. `made[id]` is the count reached (the wanted one but for prompts too short to hit)."""

    def __init__(self, ep: Endpoint):
        self.ep = ep
        self.corpus = ep.tokens.encode(corpus_text())
        if len(self.corpus) < 64:
            raise ConfigError(f"{ep.tokens.where} counts the corpus as {len(self.corpus)} tokens", "--endpoint")
        self.made: dict[int, int] = {}

    def _window(self, start: int, n: int) -> list[int]:
        c = self.corpus
        reps = (start + n) // len(c) + 2
        return (c * reps)[start:start + n]

    def text(self, length: int, key: int, head: str = "") -> str:
        """Text the endpoint counts as `length` prompt tokens: `head` (a conversation so far) and new corpus text."""
        target = max(1, length - self.ep.added_tokens)
        start = (key * 7919) % len(self.corpus)
        have = len(self.ep.tokens.encode(head)) if head else 0
        n, text, count = max(0, target - have), head, have
        for _ in range(ADJUST_TRIES):
            text = head + self.ep.tokens.decode(self._window(start, n)) if n else head
            count = len(self.ep.tokens.encode(text))
            if count == target or (count > target and n == 0):
                break
            n = max(0, n + target - count)
        self.made[key] = count + self.ep.added_tokens
        return text


@dataclass
class Outcome:
    """What the client saw of one request: when it was due and sent, each streamed token's time (a chunk of k
    tokens: k equal times), the text, the server's usage, and the error that ended it (None: it finished)."""

    spec: RequestSpec
    due_s: float
    ep: Endpoint | None = None
    sent_s: float | None = None
    client_wait_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # as the server counted them (usage)
    prompt_tokens_sent: int | None = None  # as the client's tokenizer counted them
    error: str | None = None
    end_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.error is None and self.finish_reason is not None and bool(self.token_times)

    def request(self) -> Request:
        """The outcome as the report's request (latencies from sending)."""
        s = self.spec
        r = Request(s.id, self.sent_s if self.sent_s is not None else self.due_s, s.prompt_len, s.output_len,
                    conversation=s.conversation, client_wait_s=self.client_wait_s, warmup=s.warmup)
        if self.finished:
            r.status, r.finish_reason = Status.FINISHED, self.finish_reason
            r.token_times = list(self.token_times)
            r.num_generated = len(r.token_times)
            r.first_token_s, r.finish_s = r.token_times[0], r.token_times[-1]
        else:
            r.status, r.reject_reason = Status.REJECTED, self.error or "no token streamed"
        return r

    def row(self) -> dict:
        """requests.jsonl's line: every figure the client measured."""
        times = self.token_times
        gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
        sent = self.sent_s
        return {"id": self.spec.id, "due_s": self.due_s, "sent_s": sent, "client_wait_s": self.client_wait_s,
                "prompt_len": self.spec.prompt_len, "prompt_tokens_sent": self.prompt_tokens_sent,
                "prompt_tokens_server": self.prompt_tokens, "max_tokens": self.spec.output_len,
                "output_tokens": len(times), "finish_reason": self.finish_reason, "error": self.error,
                "ttft_s": times[0] - sent if times and sent is not None else None,
                "e2e_s": times[-1] - sent if times and sent is not None else None, "itl_s": gaps,
                "token_times": times}


def request_body(ep: Endpoint, prompt: str, output_len: int, chat: bool = False) -> dict:
    """A streamed request for exactly `output_len` tokens: greedy, EOS ignored (vLLM's ignore_eos, min_tokens)."""
    body = {"model": ep.model, "max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def stream_one(client: httpx.AsyncClient, ep: Endpoint, out: Outcome, prompt: str, t0: float,
                     chat: bool = False, timeout_s: float | None = None) -> None:
    """Send one request and time its stream into `out` (seconds since `t0`). A chunk is a token unless it is an
    empty one that only carries the finish reason; the server's usage, where given, sets the count."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    out.sent_s = time.perf_counter() - t0
    try:
        usage_tokens = await asyncio.wait_for(_read_stream(client, ep.url + path, out, prompt, t0, chat), timeout_s)
    except asyncio.TimeoutError:
        out.error, usage_tokens = f"timed out after {timeout_s:g} s", None
    except (httpx.HTTPError, OSError, ValueError) as e:
        out.error, usage_tokens = f"{type(e).__name__}: {str(e)[:120] or 'connection lost'}", None
    out.end_s = time.perf_counter() - t0
    if out.error is None and out.finish_reason is None:
        out.error = "the stream ended without a finish reason"
    times = out.token_times
    if usage_tokens and times and usage_tokens != len(times):  # chunks of several tokens (or none)
        if usage_tokens > len(times):
            times += [times[-1]] * (usage_tokens - len(times))
        else:
            out.token_times = times[:usage_tokens - 1] + [times[-1]]


async def _read_stream(client: httpx.AsyncClient, url: str, out: Outcome, prompt: str, t0: float,
                       chat: bool) -> int | None:
    """The stream's chunks into `out`; the completion tokens its usage says (None: no usage)."""
    usage_tokens = None
    async with client.stream("POST", url, json=request_body(out.ep, prompt, out.spec.output_len, chat)) as r:
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {_error_message((await r.aread()).decode('utf-8', 'replace'))}"
            return None
        async for line in r.aiter_lines():
            now = time.perf_counter() - t0
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                out.error = f"stream error: {_error_message(json.dumps(chunk))}"
                return None
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
                out.prompt_tokens = chunk["usage"].get("prompt_tokens")
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason")
                if chat:
                    delta = choice.get("delta") or {}
                    text = delta.get("content")
                    token = bool(text) or (text == "" and "role" not in delta and finish is None)
                else:
                    text = choice.get("text")
                    token = bool(text) or finish is None  # an empty chunk mid-stream: a token held back
                if token:
                    out.token_times.append(now)
                    out.text += text or ""
                if finish is not None:
                    out.finish_reason = finish
    return usage_tokens


def _error_message(body: str) -> str:
    try:
        err = json.loads(body)
        err = err.get("error", err) if isinstance(err, dict) else err
        msg = err.get("message") if isinstance(err, dict) else None
        return " ".join(str(msg or err).split())[:160]
    except ValueError:
        return " ".join(body.split())[:160] or "no body"


async def _replay(ep: Endpoint, specs: list[RequestSpec], prompts: Prompts, first_texts: dict[int, str],
                  max_concurrency: int | None, chat: bool, timeout_s: float | None, progress,
                  slide: bool = False) -> list[Outcome]:
    book = arrival_book(specs, max_concurrency, slide=slide, transport=False)  # the way to the server and back is real
    by_id = {s.id: s for s in specs}
    outcomes: dict[int, Outcome] = {}
    history: dict[int, str] = {}  # a turn that ended with a later turn waiting: its prompt and answer
    wake = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    tasks: set[asyncio.Task] = set()
    done = 0
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, out: Outcome) -> None:
            nonlocal done
            if spec.after >= 0:  # a later turn: the conversation so far, then the user's new tokens
                text = await asyncio.to_thread(prompts.text, spec.prompt_len, spec.id, history.pop(spec.after, ""))
            else:
                text = first_texts[spec.id]
            out.prompt_tokens_sent = prompts.made.get(spec.id)
            await stream_one(client, ep, out, text, t0, chat, timeout_s)
            if out.finished and book.follows(spec.id):
                history[spec.id] = text + out.text
            book.ended(spec.id, out.token_times[-1] if out.finished else out.end_s, out.finished)
            done += 1
            if progress is not None:
                progress(done, len(specs))
            wake.set()

        while book.pending() or tasks:
            for send in book.due(time.perf_counter() - t0):
                spec = specs[send.index]
                out = outcomes[spec.id] = Outcome(spec, send.arrival_s, ep, client_wait_s=send.client_wait_s)
                if send.unsent:
                    out.error, out.sent_s, out.end_s = CONVERSATION_ENDED, send.arrival_s, send.arrival_s
                    done += 1
                    continue
                task = asyncio.create_task(one(spec, out))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            wait = book.next_s() - (time.perf_counter() - t0)
            if wait > 0 or not math.isfinite(wait):  # until the next arrival, or a request ends
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), timeout=min(wait, 1.0))
                except asyncio.TimeoutError:
                    pass
    return [outcomes[s.id] for s in specs if s.id in outcomes] + \
        [Outcome(by_id[s.id], math.nan, error="never sent") for s in specs if s.id not in outcomes]


def replay(ep: Endpoint, specs: list[RequestSpec], max_concurrency: int | None = None, chat: bool = False,
           timeout_s: float | None = None, progress=None, slide: bool = False) -> list[Outcome]:
    """Send the workload `specs` to the endpoint on their schedule and time every request (see the module
    docstring); `slide`: a request waiting for a slot holds the schedule back (sim.config.client.slides). Returns one
    Outcome per request, in the specs' order."""
    prompts = Prompts(ep)
    first = {s.id: prompts.text(s.prompt_len, s.id) for s in specs if s.after < 0}
    return asyncio.run(_replay(ep, specs, prompts, first, max_concurrency, chat, timeout_s, progress, slide))
