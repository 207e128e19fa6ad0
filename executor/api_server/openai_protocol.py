"""The OpenAI API's request and response bodies, as vLLM's server takes and gives them: a request checked into what
the engine needs (one 400 with the parameter at fault otherwise), and the JSON of completions, chat completions,
their streamed chunks and errors."""
from __future__ import annotations

import math
import reprlib
import time
import uuid
from dataclasses import dataclass

from executor.serving.channel import ENGINE_DIED, SERVER_STOPPED

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_STOP_STRINGS = 16

# why the scheduler turned a request away -> the HTTP status a client gets
QUEUE_FULL, QUEUE_TIMEOUT = "queue full (max_queue_len)", "queue timeout (max_queue_delay_s)"
CLIENT_GONE = "client disconnected"
CLIENT_STALLED = "client stopped reading"  # its stream was dropped after ServerLimits.stall_timeout_s


class BadRequest(Exception):
    """A request the server will not run: an OpenAI-style error body with `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code or self.status)


def error_body(message: str, kind: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def rejection(reason: str) -> BadRequest:
    """The HTTP answer to a request the engine rejected: 429 when its queue is full, 503 when it waited too long or
    the server is stopping, 400 when it can never be served."""
    if reason == QUEUE_FULL:
        return BadRequest(f"the server's queue is full ({reason}); retry later", None, 429, "rate_limit_exceeded",
                          "rate_limit_exceeded")
    if reason in (QUEUE_TIMEOUT, SERVER_STOPPED) or reason.startswith(ENGINE_DIED):
        return BadRequest(f"the server could not start the request: {reason}", None, 503, "service_unavailable",
                          "service_unavailable")
    return BadRequest(f"the request cannot be served: {reason}", "max_tokens" if "max_model_len" in reason else None)


@dataclass
class Ask:
    """What a request asks of the engine."""

    chat: bool
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    max_tokens: int | None  # None: chat's default (as much as max_model_len leaves)
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    min_tokens: int


def parse_request(body, chat: bool, model_name: str, vocab_size: int) -> Ask:
    """A /v1/completions (or, `chat`, /v1/chat/completions) body checked: BadRequest names what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"The model `{model}` does not exist; this server serves `{model_name}`", "model", 404,
                         "invalid_request_error", "model_not_found")
    prompt = _messages(body.get("messages")) if chat else _prompt(body.get("prompt"), vocab_size)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    param = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = None if chat else DEFAULT_MAX_TOKENS
    else:
        max_tokens = _int(max_tokens, param, 1)
    if _get(body, "n", 1) != 1:
        raise BadRequest("only n = 1 is served", "n")
    if body.get("logprobs") or body.get("echo") or body.get("best_of", 1) not in (1, None):
        raise BadRequest("logprobs, echo and best_of are not served", "logprobs")
    options = _get(body, "stream_options", {})
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    min_tokens = _int(_get(body, "min_tokens", 0), "min_tokens", 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({min_tokens}) must be at most {param} ({max_tokens})", "min_tokens")
    return Ask(chat=chat, prompt=prompt, max_tokens=max_tokens,
               temperature=_number(_get(body, "temperature", 1.0), "temperature", 0.0, 2.0),
               top_p=_number(_get(body, "top_p", 1.0), "top_p", 0.0, 1.0, low_open=True),
               seed=None if body.get("seed") is None else _int(body["seed"], "seed", -2**63),
               stop=_stop(body.get("stop")), stream=_bool(_get(body, "stream", False), "stream"),
               include_usage=_bool(options.get("include_usage", False), "stream_options.include_usage"),
               ignore_eos=_bool(_get(body, "ignore_eos", False), "ignore_eos"), min_tokens=min_tokens)


def _show(value) -> str:
    """A client's value quoted in an error: short, and safe for any nesting."""
    return _SHOWN.repr(value)


def _shown() -> reprlib.Repr:
    shown = reprlib.Repr()  # its keyword arguments are Python 3.12's
    shown.maxlevel, shown.maxstring, shown.maxother, shown.maxlist, shown.maxdict = 2, 40, 40, 4, 4
    return shown


_SHOWN = _shown()


def _get(body: dict, key: str, default):
    value = body.get(key)
    return default if value is None else value


def _int(value, param: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value >= 2**63:
        raise BadRequest(f"{param} must be a whole number of at least {low}, not {_show(value)}", param)
    return value


def _number(value, param: str, low: float, high: float, low_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        where = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise BadRequest(f"{param} must be a number in {where}, not {_show(value)}", param)
    return float(value)


def _bool(value, param: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{param} must be true or false, not {_show(value)}", param)
    return value


def _stop(value) -> list[str]:
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them", "stop")
    return stops


def _prompt(value, vocab_size: int) -> str | list[int]:
    """Text, or token ids (vLLM takes both); a list of one of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not all(0 <= t < vocab_size for t in value):
            raise BadRequest(f"prompt token ids must be in 0..{vocab_size - 1}", "prompt")
        return value
    raise BadRequest("prompt must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role and content", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are served", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be text", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk(rid: str, chat: bool, model: str, created: int, text: str | None, finish: str | None,
          role: bool = False) -> dict:
    """One streamed chunk: the text one engine step added (and the finish reason on the last)."""
    if chat:
        delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def response(rid: str, chat: bool, model: str, created: int, text: str, finish: str, use: dict) -> dict:
    """A whole (not streamed) completion."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
                "usage": use}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": use}


def models_body(model: str, max_model_len: int, created: int | None = None) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created or int(time.time()),
                                        "owned_by": "infersim", "root": model, "max_model_len": max_model_len}]}
