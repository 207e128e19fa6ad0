"""A progress bar for a command's long loops, on a terminal only."""
from __future__ import annotations

import sys


class progress_bar:
    """A progress bar on a terminal (a callback taking (done, total)); nothing when quiet or piped. `console`: a rich
    Console to draw on (None: standard error's, made only when a bar is drawn: rich is not imported otherwise)."""

    def __init__(self, console, quiet: bool, what: str, total: int):
        if console is None and not quiet and sys.stderr.isatty():
            from rich.console import Console

            console = Console(stderr=True)
        self.show = not quiet and console is not None and console.is_terminal
        self.console, self.what, self.total = console, what, total

    def __enter__(self):
        if not self.show:
            return None
        from rich.progress import Progress

        self.bar = Progress(console=self.console, transient=True)
        self.bar.__enter__()
        task = self.bar.add_task(self.what, total=self.total)
        return lambda done, total: self.bar.update(task, completed=done)

    def __exit__(self, *exc):
        if self.show:
            self.bar.__exit__(*exc)
        return False
