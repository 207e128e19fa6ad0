"""Prompts of exactly the lengths a workload asks for, cut from real text shipped with the project."""
from __future__ import annotations

from importlib.resources import files

CORPUS = "declaration_of_independence.txt"
PLAIN = "plain_paragraphs.txt"  # modern prose the model copies nearly verbatim (see data/README.md)


def corpus_ids(tokenizer, vocab_size: int | None = None) -> list[int]:
    """The shipped text as token ids (no special tokens); without a tokenizer (a bare checkpoint, e.g. a
    tiny test model) arbitrary ids, since only the prompts' lengths matter then. `vocab_size`: only the ids a
    model of that vocabulary embeds (a small random-weight model's)."""
    if tokenizer is None:
        ids = list(range(3, 1000))
    else:
        ids = tokenizer.encode((files("executor") / "data" / CORPUS).read_text(), add_special_tokens=False)
    return ids if vocab_size is None else [i for i in ids if i < vocab_size]


def prompt_ids(corpus: list[int], length: int, request_id: int, prefix: tuple = (), prefix_unit: int = 0) -> list[int]:
    """`length` consecutive ids of the corpus, read cyclically from a start that depends on the request; with shared
    content (RequestSpec.prefix: content ids of `prefix_unit` tokens each), each unit's tokens come from a start that
    depends on its id alone, so prompts of equal ids begin with equal tokens (sim/policy/prefix.py hashes them alike)."""
    ids: list[int] = []
    for cid in prefix:
        if len(ids) >= length:
            break
        ids += _window(corpus, (cid * 104729 + 17) % len(corpus), min(prefix_unit, length - len(ids)))
    return ids + _window(corpus, (request_id * 7919) % len(corpus), length - len(ids))


def next_turn_ids(corpus: list[int], history: list[int], length: int, request_id: int) -> list[int]:
    """A conversation's next prompt of `length` ids: the turn before it (its prompt and generated tokens) and the
    user's new tokens; what the sim's block hashes of a conversation stand for (sim/policy/prefix.py)."""
    head = history[:length]
    return head + _window(corpus, (request_id * 7919) % len(corpus), length - len(head))


def _window(corpus: list[int], start: int, length: int) -> list[int]:
    reps = (start + length) // len(corpus) + 1
    return (corpus * (reps + 1))[start:start + length]


def paragraphs(n: int | None = None) -> list[str]:
    """Passages of the shipped text, 40-90 words each (cut at sentence ends); the first n, or all."""
    text = (files("executor") / "data" / CORPUS).read_text()
    sentences = [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.split()) > 4]
    out, cur = [], []
    for s in sentences:
        cur.append(s)
        if sum(len(x.split()) for x in cur) >= 40:
            out.append(" ".join(cur))
            cur = []
        if len(out) == n:
            break
    return [p if len(p.split()) <= 90 else " ".join(p.split()[:90]) for p in out]


def plain_paragraphs(n: int | None = None) -> list[str]:
    """The shipped notices in plain modern English (blank-line separated, 60-70 words each); the first n, or all."""
    text = (files("executor") / "data" / PLAIN).read_text()
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()][:n]
