"""One error type for bad user input: the CLI prints it as one line and exits with code 2."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

# what the CLI prints after "infersim: error: " stays within 300 characters
MAX_LINE = 280


class ConfigError(Exception):
    """Bad user input, located by file and key path (e.g. ``serving.max_num_seqs``)."""

    def __init__(self, message: str, key_path: str = "", file: str | None = None):
        self.message = message
        self.key_path = key_path
        self.file = file
        super().__init__(self.one_line())

    def with_file(self, file: str) -> "ConfigError":
        """Return a copy that names `file` (the file is known only at the top)."""
        return ConfigError(self.message, self.key_path, self.file or file)

    def one_line(self) -> str:
        """`file: key.path: what is wrong and what is allowed`, on one line of at most MAX_LINE characters (the
        message is cut, never the file or the key path)."""
        where = ": ".join([_printable(p) for p in (self.file, self.key_path) if p] + [""])
        message = _printable(" ".join(self.message.split()))
        room = max(40, MAX_LINE - len(where))
        return where + (message if len(message) <= room else message[:room - 1] + "…")


def _printable(text: str) -> str:
    """`text` with control characters escaped (a key holding a newline or a terminal escape would break the one
    line, or rewrite the user's terminal)."""
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def catalog_entry(catalog: Mapping, name: str, what: str, instead: str, key_path: str):
    """The entry of `catalog` named `name`, case-insensitively; else a ConfigError naming the `what` unknown and
    listing what is allowed: the catalog's names, then `instead` (what a scenario may give in its place)."""
    for known in catalog:  # by name: a lazy catalog builds only the entry it returns
        if known.lower() == name.lower():
            return catalog[known]
    raise ConfigError(f"unknown {what} {name!r}; allowed: {', '.join(catalog)}{instead}", key_path)


class LazyCatalog(Mapping):
    """A catalog (name: entry) whose entries are built on their first lookup, each once: a run builds the one
    entry it names, not the model or device catalog's every spec."""

    def __init__(self, makers: dict[str, Callable[[], object]]):
        self._makers, self._built = makers, {}

    def __getitem__(self, name: str):
        if name not in self._built:
            self._built[name] = self._makers[name]()
        return self._built[name]

    def __contains__(self, name) -> bool:
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)
