"""What `infersim serve` of a speculative scenario measures for the simulator: the drafter's time per step,
verify_cost_ratio, and the scenario's speculative section with those numbers in it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from sim.config.plan import Plan
from sim.cost.pricer import StepPricer
from sim.cost.speculation import reference_step_s

# fewer plain decode steps than this: too few to read the run's speed off (taken as 1). A draft-model or Medusa
# serve has only a handful (requests' last tokens), and they read its speed better than 1 does: in the
# 2026-11-30 17:21 calibration serves, which ran 12-24% slow, 4 and 6 of them said 1.24 and 1.18.
MIN_PLAIN_STEPS = 4


def draft_cost(records: list, cost=None) -> dict:
    """Speculation's cost per step as the simulator charges it. The drafter's time ≈ draft_s_per_step +
    draft_s_per_seq × requests that drafted + draft_s_per_token × tokens its own model caught up on (a draft
    model reads a new request's prompt at its first draft), fitted by non-negative least squares over the decode
    steps in which the drafter ran, those where it proposed nothing included (prompt lookup searched and found no
    n-gram), from what the executor measured of it (each record's draft_s).
    Given the fitted step-cost model the simulator uses (`cost`), the serve's speed against it is read off its
    plain decode steps (where it has MIN_PLAIN_STEPS of them): the drafter's times are divided by it and
    `draft_s_reference_step` says at what speed they are (the model's one-row decode step), so the simulator
    scales them with its own profile as it does the target's steps — the drafter runs on the same machine, and a
    serve on a machine running 15% slow would otherwise charge 15% too much on a fast day. Also
    verify_cost_ratio: the verify forwards' measured time over that model's prediction for their shapes (its
    linear form does not follow small verify batches or candidate trees exactly), at the same speed. A ratio,
    not a time difference, so it carries over to another profile of the same device (`validate
    --profile-alongside`)."""
    from scipy.optimize import nnls

    ran = [r for r in records if r.draft_s > 0 and not r.num_prefill and r.num_decode]
    steps = [r for r in ran if r.num_drafted > 0]  # the verify forwards
    if len(steps) < 2:
        return {}
    speed, out = 1.0, {}
    if cost is not None:
        pricer = StepPricer(cost)  # the cost model's own price: verify_cost_ratio is what this measures

        def predict(r):
            return pricer.record_s(r.to_json())

        # the machine's speed during this run, read off its plain decode steps, is not speculation's cost
        plain = [r for r in records if r.num_drafted == 0 and not r.num_prefill and r.num_decode]
        if len(plain) >= MIN_PLAIN_STEPS:
            speed = sum(r.end_s - r.start_s - r.draft_s for r in plain) / sum(predict(r) for r in plain)
        measured = sum(r.end_s - r.start_s - r.draft_s for r in steps)
        pred = sum(predict(r) for r in steps)
        out.update(verify_cost_ratio=float(measured / (pred * speed)), verify_step_ratio=float(measured / pred),
                   plain_decode_step_ratio=float(speed), plain_decode_steps=len(plain),
                   draft_s_reference_step=reference_step_s(cost))
    rows = np.array([sum(q > 1 for q in r.new_tokens[:r.num_decode]) for r in ran], dtype=float)  # verify rows
    fed = np.array([r.draft_fed_tokens for r in ran], dtype=float)
    c, _ = nnls(np.column_stack([np.ones_like(rows), rows, fed]), np.array([r.draft_s for r in ran]) / speed)
    out.update(draft_s_per_step=float(c[0]), draft_s_per_seq=float(c[1]))
    if fed.any():  # a drafter with a model of its own
        out["draft_s_per_token"] = float(c[2])
    return out


class _FlowLeaves(yaml.SafeDumper):
    """YAML with lists of plain values on one line ([0.243, 0.318]), the rest in block style."""

    def represent_list(self, data):
        flat = all(not isinstance(x, (list, dict)) for x in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_FlowLeaves.add_representer(list, _FlowLeaves.represent_list)


def calibrated_speculative(plan: Plan, measured: dict) -> dict:
    """The scenario's speculative section with what this serve measured in the simulator's fields (per-request
    rates or a tree drafter's rank probabilities, the drafter's time, verify_cost_ratio): what `infersim run` of
    the scenario needs to simulate this drafter on this device."""
    key = plan.speculative.rank_probs_key  # Medusa's, EAGLE's: per depth, the chance of each candidate rank
    spec = {"method": plan.speculative.method, **plan.speculative.model_dump(
        exclude_unset=True, exclude_none=True, exclude={"acceptance_rate", "proposal_rate", "request_rates",
                                                        "medusa_rank_probs", "eagle_rank_probs", "draft_s_per_step",
                                                        "draft_s_per_seq", "draft_s_per_token",
                                                        "draft_s_reference_step", "verify_cost_ratio"})}
    if key is not None:
        spec[key] = [[round(p, 4) for p in row] for row in measured[key]]
        spec["proposal_rate"] = round(measured["proposal_rate"] or 0.0, 3)
    elif measured["request_rates"]:
        spec["request_rates"] = measured["request_rates"]
    else:  # no request decoded: the pooled rates, if any
        spec.update(acceptance_rate=round(measured.get("alpha") or 0.0, 3),
                    proposal_rate=round(measured.get("proposal_rate") or 0.0, 3))
    for key in ("draft_s_per_step", "draft_s_per_seq", "draft_s_per_token", "draft_s_reference_step"):
        if key in measured:
            spec[key] = round(measured[key], 8 if key == "draft_s_per_token" else 6)
    if "verify_cost_ratio" in measured:
        spec["verify_cost_ratio"] = round(measured["verify_cost_ratio"], 3)
    return spec


def write_speculative_yaml(path: Path, plan: Plan, measured: dict) -> None:
    """speculative.yaml: the scenario's speculative section as this serve measured it, ready to paste."""
    path.write_text(yaml.dump({"speculative": calibrated_speculative(plan, measured)}, Dumper=_FlowLeaves,
                              sort_keys=False, width=110))
