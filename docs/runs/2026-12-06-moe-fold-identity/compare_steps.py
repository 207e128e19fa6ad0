"""Compare two price_steps.py outputs: per scenario and price, how many shapes differ and the largest relative change.

usage: python3 compare_steps.py A.json B.json
"""
import json
import sys


def compare(a: dict, b: dict) -> str:
    """One scenario's differences, or IDENTICAL (every price the same float)."""
    ra, rb = a["rows"], b["rows"]
    assert [r["shape"] for r in ra] == [r["shape"] for r in rb], "different shapes"
    out = []
    for key in ra[0]:
        if key in ("kind", "shape"):
            continue
        pairs = [(float(x[key]), float(y[key])) for x, y in zip(ra, rb) if key in x and x[key] != y[key]]
        if pairs:
            worst = max(abs(y - x) / abs(x) if x else float("inf") for x, y in pairs)
            out.append(f"{key} {len(pairs)}/{len(ra)} max {100 * worst:.3g}%")
    return "; ".join(out) or "IDENTICAL"


if __name__ == "__main__":
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
    for path in a:
        print(f"{path} ({a[path]['cost_model']} vs {b[path]['cost_model']}): {compare(a[path], b[path])}")
