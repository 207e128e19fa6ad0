"""Reading a scenario's YAML within bounds: a size cap, no duplicate keys, and a cap on the document's size with
every alias expanded (a "billion laughs" file is a few hundred bytes that expand to gigabytes once validated)."""
from __future__ import annotations

from pathlib import Path

import yaml

from sim.config.errors import ConfigError
from sim.config.limits import MAX_SCENARIO_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, MAX_YAML_STRING

# libyaml's parser where PyYAML was built with it: the pure-Python one takes ~13 s for a 1 MB file of 150,000 values
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (YAML says so; PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys come first, the node's override them
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict, set)):  # unhashable: PyYAML would fail with a TypeError
                raise ConfigError(f"a key that is a {type(key).__name__} (line {key_node.start_mark.line + 1}); "
                                  "allowed: a plain name")
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"key {str(key)[:60]!r} given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


MAX_INT_DIGITS = 100  # past Python's 4,300-digit limit int() raises; the bounds of each key name it below that


def _construct_int(loader, node):
    if len(node.value) > MAX_INT_DIGITS:
        raise ConfigError(f"a number of {len(node.value):,} characters (line {node.start_mark.line + 1}); allowed: at "
                          f"most {MAX_INT_DIGITS} digits")
    return _SafeLoader.construct_yaml_int(loader, node)


def _refuse_binary(loader, node):  # bytes pass pydantic as text or a number, and break JSON copies of the scenario
    raise ConfigError(f"a !!binary value (line {node.start_mark.line + 1}); allowed: plain numbers and text")


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:binary", _refuse_binary)


def _check_size(node: yaml.Node) -> None:
    """The document's node count with aliases expanded, its depth and its longest scalar, within the limits."""
    sizes: dict[int, int] = {}
    stack = [(node, 1, False)]
    while stack:  # iterative: a 100,000-deep document must not exhaust Python's stack here
        n, depth, done = stack.pop()
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_YAML_DEPTH} levels")
        if isinstance(n, yaml.ScalarNode):
            if len(n.value) > MAX_YAML_STRING:
                raise ConfigError(f"a value of {len(n.value):,} characters (line {n.start_mark.line + 1}); allowed: "
                                  f"at most {MAX_YAML_STRING:,}")
            sizes[id(n)] = 1
            continue
        kids = [x for pair in n.value for x in pair] if isinstance(n, yaml.MappingNode) else list(n.value)
        if done:
            sizes[id(n)] = 1 + sum(sizes[id(k)] for k in kids)
            if sizes[id(n)] > MAX_YAML_NODES:
                raise ConfigError(f"the document expands to more than {MAX_YAML_NODES:,} values (aliases "
                                  "included); allowed: a scenario of ordinary size")
        elif id(n) not in sizes:
            stack.append((n, depth, True))
            stack.extend((k, depth + 1, False) for k in kids if id(k) not in sizes)


def _check_events(text: str) -> None:
    """Nesting depth and size from the parser's event stream, before the (recursive) composer builds a tree:
    PyYAML composes a 5,000-deep document slowly and a 100,000-deep one not at all."""
    depth = events = 0
    for event in yaml.parse(text, Loader=_SafeLoader):
        events += 1
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise ConfigError(f"nested deeper than {MAX_YAML_DEPTH} levels (line {event.start_mark.line + 1})")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
        if events > MAX_YAML_NODES:
            raise ConfigError(f"more than {MAX_YAML_NODES:,} values; allowed: a scenario of ordinary size")


def read_yaml(path: Path):
    """The YAML document in `path`; ConfigError (naming the file) for anything unreadable or out of bounds."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ConfigError("not a regular file", file=str(path))
        if size > MAX_SCENARIO_BYTES:
            raise ConfigError(f"{size / 2**20:.1f} MiB; allowed: at most {MAX_SCENARIO_BYTES // 2**20} MiB",
                              file=str(path))
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text (a scenario is a UTF-8 YAML file; UTF-16 and other encodings: convert it)",
                          file=str(path)) from None
    except OSError as e:
        raise ConfigError(f"cannot read it ({type(e).__name__})", file=str(path)) from None
    try:
        return load_yaml(text)
    except ConfigError as e:
        raise e.with_file(str(path)) from None


def load_yaml(text: str):
    """The YAML document in `text`, within the same bounds as a file; ConfigError for anything else."""
    try:
        _check_events(text)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_size(node)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except RecursionError:
        raise ConfigError(f"nested deeper than {MAX_YAML_DEPTH} levels") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = str(getattr(e, "problem", None) or type(e).__name__)[:120]
        raise ConfigError(f"not valid YAML{where}: {problem}") from None
