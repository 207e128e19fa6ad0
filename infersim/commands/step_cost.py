"""`infersim step-cost`: one engine step's time and where it goes (also `infersim.api.step_time`, the What-if page):
the simulator's own pricer for the step's batch shape, by part."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from infersim.inputs import load_plan
from infersim.tables import wide_console
from sim.config.errors import ConfigError
from sim.config.generator import plan_requests
from sim.config.plan import Plan, plan_of
from sim.cost.build import describe_cost, make_pricer
from sim.policy.batch import shape_of
from sim.report.outputs import cost_line

MAX_ROWS = 1_000_000  # a step of more rows than any engine batches


@dataclass
class Step:
    """A step to price: per sequence its new tokens and its context after the step; `num_prefill` of the rows (the
    last ones) compute a prompt chunk (None: those with more than one new token)."""

    label: str
    new_tokens: list[int]
    context_lens: list[int]
    num_prefill: int | None = None


def step_of(label: str, new_tokens: list[int], context_lens: list[int] | None = None) -> Step:
    """A step from per-row new tokens and contexts (default: each row's context is its new tokens, a prompt's first
    chunk), checked: one line naming the flag for bad input."""
    if not new_tokens or len(new_tokens) > MAX_ROWS:
        raise ConfigError(f"{len(new_tokens)} rows; allowed: 1 to {MAX_ROWS:,}", "--new-tokens")
    if any(n < 1 for n in new_tokens):
        raise ConfigError(f"{min(new_tokens)} new tokens in a row; allowed: 1 or more", "--new-tokens")
    context_lens = list(new_tokens) if not context_lens else context_lens
    if len(context_lens) != len(new_tokens):
        raise ConfigError(f"{len(context_lens)} context lengths for {len(new_tokens)} rows; allowed: one per row "
                          "(or none: each row's own new tokens)", "--context")
    short = [(n, c) for n, c in zip(new_tokens, context_lens) if c < n]
    if short:
        raise ConfigError(f"context {short[0][1]} below the row's {short[0][0]} new tokens; allowed: a context that "
                          "counts the step's own tokens (tokens in the KV cache after the step)", "--context")
    return Step(label, list(new_tokens), list(context_lens))


def pool_plan(plan: Plan, step: Step, pool: str | None = None) -> Plan:
    """The plan that prices `step`: the scenario's, or a disaggregated one's prefill pool for a step of prompt chunks
    alone and its decode pool otherwise (or the pool named)."""
    if plan.pools is None:
        if pool is not None:
            raise ConfigError(f"{pool!r}: the scenario has no pools; allowed: no --pool", "--pool")
        return plan
    if pool is None:
        prefill_only = all(n > 1 for n in step.new_tokens) if step.num_prefill is None else \
            step.num_prefill == len(step.new_tokens)
        pool = "prefill" if prefill_only else "decode"
    if pool not in ("prefill", "decode"):
        raise ConfigError(f"{pool!r}; allowed: prefill, decode", "--pool")
    return getattr(plan.pools, pool)


def price(plan: Plan, step: Step, pool: str | None = None) -> dict:
    """{"total_s", the parts ("linear_s", "attention_s", "communication_s", "lm_head_s", "overhead_s", "draft_s",
    "swap_s", "experts_s": a mixture of experts' routed experts), "source": what priced it}."""
    p = pool_plan(plan, step, pool)
    cost = make_pricer(p).step_cost(shape_of(step.new_tokens, step.context_lens, num_prefill=step.num_prefill))
    return {**cost.to_json(), "source": describe_cost(p)["source"]}


def typical_steps(plan: Plan, decode_batches: list[int] | None = None) -> list[Step]:
    """A prefill of the workload's median prompt (its first chunk, where chunked prefill caps it) and decode steps of
    `decode_batches` rows (default: 1, 8, 32 and max_num_seqs, as far as it allows), each row's context the median
    prompt and half the median output."""
    specs = plan_requests(plan)
    prompt = max(1, int(statistics.median(s.prompt_len for s in specs)))
    output = max(1, int(statistics.median(s.output_len for s in specs)))
    sched = (plan.pools.prefill if plan.pools is not None else plan).scheduler
    chunk = min(prompt, sched.max_num_batched_tokens) if sched.enable_chunked_prefill else prompt
    steps = [Step(f"prefill {chunk}" + (f" of {prompt}" if chunk < prompt else ""), [chunk], [chunk])]
    most = (plan.pools.decode if plan.pools is not None else plan).scheduler.max_num_seqs
    context = prompt + output // 2
    for b in sorted({min(b, most) for b in (decode_batches or [1, 8, 32, most]) if b >= 1}):
        steps.append(Step(f"decode {b} x {context}", [1] * b, [context] * b, 0))
    return steps


def decode_batch_of(report: dict) -> int:
    """The mean number of sequences decoding in a run (Little's law: completions per second x each one's time from
    its first token to its last)."""
    decode_s = (report["e2e_s"]["mean"] or 0.0) - (report["ttft_s"]["mean"] or 0.0)
    return max(1, round(report["throughput"]["requests_per_s"] * decode_s))


def step_time(data: dict | str | Path, new_tokens: list[int], context_lens: list[int] | None = None,
              pool: str | None = None, base_dir: Path = Path(".")) -> dict:
    """One step's time and where it goes, as the simulator prices it for a scenario (a mapping, or a YAML file): a
    dict with total_s, linear_s (the decoder layers' non-attention work: projections, norms, rotary, activation,
    residual adds; not embedding or LM head), attention_s, communication_s, lm_head_s, overhead_s, draft_s, swap_s,
    and source (what priced it: profile, gpu_kernels or roofline). `new_tokens` and `context_lens` (tokens in the
    KV cache after the step; default: each row's new tokens): one per sequence; rows of more than one token compute
    a prompt chunk. A disaggregated scenario prices prompt-only steps on its prefill pool, others on its decode pool
    (or `pool`)."""
    plan = load_plan(data) if isinstance(data, (str, Path)) else plan_of(data, base_dir)
    return price(plan, step_of("step", list(new_tokens), list(context_lens) if context_lens else None), pool)


def step_costs(plan: Plan, steps=None, report: dict | None = None) -> list[tuple[str, dict]]:
    """(label, step_time's dict) of `steps` (Step), default the scenario's typical ones: a prefill
    of its median prompt and decodes of 1, 8, 32 and max_num_seqs rows, or with a run's `report` of its mean decode
    batch."""
    if steps is None:
        steps = typical_steps(plan, [decode_batch_of(report)] if report is not None else None)
    return [(s.label, price(plan, s)) for s in steps]


def price_steps(path: Path, new_tokens: list[int] | None = None, context: list[int] | None = None,
                pool: str | None = None) -> tuple[Plan, list[tuple[str, dict]], dict]:
    """A scenario file's plan, (label, step_time's dict) of the step `new_tokens` and `context` give (default: the
    scenario's typical steps), and what priced them (sim.cost.build.describe_cost)."""
    plan = load_plan(path)
    steps = [step_of("step", new_tokens, context)] if new_tokens else None
    if pool is not None and steps is None:
        raise ConfigError("names the pool of a step given by --new-tokens", "--pool")
    rows = [("step", step_time(path, steps[0].new_tokens, steps[0].context_lens, pool))] if steps \
        else step_costs(plan)
    return plan, rows, describe_cost(plan.pools.decode if plan.pools is not None else plan)


def print_step_costs(plan: Plan, rows: list[tuple[str, dict]], priced: dict) -> None:
    """Each step's total and its parts (those not zero in every row), in ms and as a share, and what priced them."""
    parts = [p for p in ("linear_s", "experts_s", "attention_s", "communication_s", "lm_head_s", "overhead_s", "draft_s",
                         "swap_s") if any(r[p] for _, r in rows)]
    t = Table("step", "total ms", *(f"{p[:-2].replace('_', ' ')} ms (%)" for p in parts), title=plan.name)
    for label, r in rows:
        t.add_row(label, f"{r['total_s'] * 1e3:.3f}",
                  *(f"{r[p] * 1e3:.3f} ({100 * r[p] / r['total_s']:.0f}%)" if r["total_s"] else "0" for p in parts))
    console = wide_console()
    console.print(t)
    console.print(f"priced by: {cost_line(priced)}")
