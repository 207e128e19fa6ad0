"""Price one fixed set of step shapes with a tree's own `make_cost_model`, for each scenario given; write every price
as its repr (so that two trees' prices compare bit for bit).

usage: cd TREE && PYTHONPATH=$PWD python3 price_steps.py OUT.json SCENARIO.yaml ...
"""
import json
import random
import sys

from sim.config.plan import load_scenario
from sim.cost.build import make_cost_model
from sim.policy.batch import BatchShape

PARTS = ("total_s", "linear_s", "attention_s", "communication_s", "lm_head_s", "overhead_s", "swap_s", "experts_s")


def shapes(max_seqs: int, max_tokens: int, rng: random.Random) -> list[tuple[str, BatchShape]]:
    """Decode steps of 1 .. max_seqs rows, and 60 steps of a few prompt chunks beside decode rows."""
    out = []
    rows = {1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 100, 128, 129, 200, 255, 256, 257, 300, max_seqs}
    for n in sorted(rows | {rng.randint(1, max_seqs) for _ in range(20)}):
        if n <= max_seqs:
            ctx = n * rng.randint(50, 3000)
            out.append(("decode", BatchShape(n, n, ctx, ctx, n)))
    for _ in range(60):
        dec = rng.randint(0, max_seqs - 1)
        pre = rng.randint(1, min(4, max_seqs - dec))
        chunk = [rng.randint(1, max(1, (max_tokens - dec) // pre)) for _ in range(pre)]
        before = [rng.choice([0, 0, rng.randint(1, 2000)]) for _ in range(pre)]
        pctx = sum(c + b for c, b in zip(chunk, before))
        pairs = sum(c * b + c * (c + 1) // 2 for c, b in zip(chunk, before))
        dctx = dec * rng.randint(50, 2000)
        out.append(("mixed", BatchShape(dec + pre, dec + sum(chunk), dctx + pctx, dctx + pairs,
                                        dec + rng.randint(0, pre), 0, pre, 0, sum(chunk), pctx)))
    return out


def price(path: str) -> dict:
    """The scenario's cost model and its prices of the shapes (seeded: the same shapes in every tree)."""
    _, plan = load_scenario(path)
    cost = make_cost_model(plan)
    # main reads the layout where used; dcf4f8e's Plan forwarded it
    layout = getattr(plan, "expert_layout", None)
    dp = max(1, layout.data_parallel_size if layout is not None else plan.data_parallel_size)
    rows = []
    for kind, s in shapes(plan.scheduler.max_num_seqs * dp, plan.scheduler.max_num_batched_tokens * dp,
                          random.Random(58)):
        c = cost.step_cost(s)
        row = {"kind": kind, "shape": [s.num_seqs, s.num_new_tokens, s.sum_context, s.attn_pairs, s.num_sampled,
                                       s.num_prefill, s.prefill_tokens, s.prefill_context],
               "step_time": repr(cost.step_time(s)), **{p: repr(getattr(c, p)) for p in PARTS}}
        if kind == "decode":
            row["decode_time"] = repr(cost.decode_time(s.num_seqs, s.sum_context))
        rows.append(row)
    return {"cost_model": type(cost).__name__, "rows": rows}


if __name__ == "__main__":
    json.dump({path: price(path) for path in sys.argv[2:]}, open(sys.argv[1], "w"), indent=0)
