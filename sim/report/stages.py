"""report.json's `stages` section: a workload with load stages (workload.load_stages) reported stage by stage, as
inference-perf writes a report per stage: what was sent (count, rate asked and achieved), what completed and how
fast, the latencies as vLLM's benchmark defines them, and whether the deployment kept up with the stage's rate."""
from __future__ import annotations

from dataclasses import fields, replace

import numpy as np

from sim.config.stages import stage_bounds
from sim.report.metrics import RequestRecords, compute_metrics, summarize_gaps
from sim.report.text_table import text_table

# a stage kept up when this share of its requests completed ...
KEEPS_UP_COMPLETED = 0.99
# ... and their mean TTFT stayed under this share of the stage's length: behind its rate, a backlog grows through the
# stage and the mean wait with it (about half the backlog's age at the end), seconds to minutes; kept up, a request
# waits for at most a few steps (the published vLLM runs: at most 0.12 s, against 100 s and more where it fell behind)
KEEPS_UP_TTFT_SHARE = 0.01


def keeps_up(sent: int, completed: int, ttft_mean_s: float | None, duration_s: float) -> bool:
    """Whether a deployment kept up with a stage's rate (see KEEPS_UP_*): the one rule for simulated, served and
    published stages alike."""
    return sent > 0 and completed >= KEEPS_UP_COMPLETED * sent and ttft_mean_s is not None \
        and ttft_mean_s <= KEEPS_UP_TTFT_SHARE * duration_s


def subset(rec: RequestRecords, mask: np.ndarray) -> RequestRecords:
    """The records of the requests in `mask`, without inter-token gaps (the run's are summarized as one sample)."""
    out = {}
    for f in fields(rec):
        if f.name == "itl":
            continue
        v = getattr(rec, f.name)
        out[f.name] = [x for x, keep in zip(v, mask) if keep] if isinstance(v, list) else \
            v[mask] if isinstance(v, np.ndarray) else v
    return replace(rec, **out, itl=summarize_gaps([np.zeros(0), np.zeros(0, np.int64)]))


def stage_sections(plan, rec: RequestRecords) -> list[dict]:
    """Per load stage of the plan's workload: its rate and length, what was sent and when, and the metrics of its
    requests (compute_metrics, no inter-token gaps); `completed_rate` is inference-perf's requests_per_sec (completed
    over first send to last end)."""
    cfg = plan.workload.load_stages
    out = []
    for k, ((first, end), st) in enumerate(zip(stage_bounds(cfg), cfg.stages)):
        mask = (rec.id >= first) & (rec.id < end)
        sub = subset(rec, mask)
        m = compute_metrics(sub, plan.slo)
        del m["itl_s"]
        sent = int(mask.sum())
        span = float(sub.arrival_s.max() - sub.arrival_s.min()) if sent > 1 else 0.0
        last = np.nanmax(np.where(sub.completed, sub.finish_s, sub.arrival_s)) if sent else np.nan
        busy = float(last - sub.arrival_s.min()) if sent else 0.0
        done = m["requests"]["completed"]
        out.append({"stage": k, "rate": st.rate, "duration_s": st.duration_s, "sent": sent,
                    "start_s": float(sub.arrival_s.min()) if sent else None, "send_duration_s": span,
                    "achieved_rate": sent / span if span > 0 else None,
                    "completed_rate": done / busy if busy > 0 else None,
                    "keeps_up": keeps_up(sent, done, m["ttft_s"]["mean"], st.duration_s), **m})
    return out


def stages_table(report: dict) -> str:
    """The console's per-stage table, when the report has stages ('' when not)."""
    stages = report.get("stages")
    if not stages:
        return ""
    rows = [[str(s["stage"]), f"{s['rate']:g}", _num(s["achieved_rate"]), f"{s['requests']['completed']}/{s['sent']}",
             _num(s["ttft_s"]["mean"], 1000), _num(s["tpot_s"]["mean"], 1000), _num(s["e2e_s"]["p50"]),
             "yes" if s["keeps_up"] else "no"] for s in stages]
    return text_table(["stage", "rate", "sent/s", "done", "TTFT ms", "TPOT ms", "E2E s", "kept up"], rows,
                      title="per stage: the rate asked and sent; means of TTFT and TPOT, E2E p50")


def _num(x, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.3g}"
