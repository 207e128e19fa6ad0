"""A scenario mapping with one dotted key set (`serving.max_num_seqs`, `pools`, `model.weight_dtype`): how
`infersim search` makes its configurations and `infersim compare --sweep` its values."""
from __future__ import annotations

import json


def apply(base: dict, key: str, value) -> dict:
    """`base` with one dotted key set (a copy); `pools: [P, D]` sets the pools' replicas, `model.weight_dtype` on a
    catalog name becomes {base: name, weight_dtype: ...}."""
    data = json.loads(json.dumps(base))
    parts = key.split(".")
    if parts == ["pools"]:
        if value is None:
            data.pop("pools", None)
        elif is_ratio(value):
            pools = data.get("pools") or {"prefill": {}, "decode": {}}
            pools["prefill"] = {**pools.get("prefill", {}), "replicas": value[0]}
            pools["decode"] = {**pools.get("decode", {}), "replicas": value[1]}
            data["pools"] = pools
            data.pop("replicas", None)
        else:
            data["pools"] = value
        return data
    if parts[0] in ("model", "hardware") and len(parts) > 1 and isinstance(data.get(parts[0]), str):
        data[parts[0]] = {"base": data[parts[0]]}
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value
    return data


def is_ratio(v) -> bool:
    """A [prefill, decode] pair of replica counts (`pools: [1, 3]`)."""
    return isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                       for x in v)
