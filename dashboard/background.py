"""Long work off the script thread: a progress bar and a Cancel button while it runs."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import streamlit as st

Progress = Callable[[int, int], None]


class Cancelled(Exception):
    """The user pressed Cancel."""


def stoppable(progress: Progress, cancel: threading.Event) -> Progress:
    """A progress callback that raises Cancelled once `cancel` is set: stops work that only reports progress."""
    def report(done: int, total: int) -> None:
        if cancel.is_set():
            raise Cancelled
        progress(done, total)
    return report


def run(work: Callable[[Progress, threading.Event], Any], label: str, key: str) -> Any:
    """Run `work(progress, cancel)` in a thread while a progress bar follows its `progress(done, total)` calls;
    returns its result or raises its exception. Cancel reruns the page, which interrupts the wait here: the
    work is then told through `cancel` and its result dropped (`cancelled(key)` says so on the next run)."""
    state = {"done": 0, "total": 0}
    box: dict = {}

    def progress(done: int, total: int) -> None:
        state.update(done=done, total=total)

    cancel = threading.Event()

    def target() -> None:
        try:
            box["result"] = work(progress, cancel)
        except BaseException as e:  # handed to the script thread, which shows it
            box["error"] = e

    bar = st.progress(0.0, text=label)
    button = st.empty()
    button.button("Cancel", key=key, on_click=lambda: st.session_state.update({f"{key}.cancelled": True}))
    thread = threading.Thread(target=target, daemon=True, name=f"dashboard-{key}")
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
            done, total = state["done"], state["total"]
            text = f"{label}: {done:,} of {total:,}" if total else label
            bar.progress(min(1.0, done / total) if total else 0.0, text=text)
    finally:
        cancel.set()  # a rerun stopped the wait: the work stops at its next check
    bar.empty()
    button.empty()
    if isinstance(box.get("error"), Cancelled):
        return None
    if "error" in box:
        raise box["error"]
    return box.get("result")


def cancelled(key: str) -> bool:
    """Whether the run under `key` was cancelled since the last call (once)."""
    return bool(st.session_state.pop(f"{key}.cancelled", False))
