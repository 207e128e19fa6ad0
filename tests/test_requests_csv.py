"""requests.csv is written a column at a time (issue 59), byte for byte as the csv module's writer writes its rows:
quoting, NaN as an empty field, extra columns of any kind, no requests at all."""
from __future__ import annotations

import csv
import io

import numpy as np

from sim.report.metrics import GapSummary, RequestRecords, per_request_latency
from sim.report.outputs import HEADER, write_requests_csv

REASONS = ["", "queue timeout (max_queue_delay_s)", 'prompt of 9,000 tokens > "max_model_len"', "two\nlines",
           "carriage\rreturn", "nan"]


def records(n: int, rng) -> RequestRecords:
    completed = rng.random(n) < 0.7
    arrival = rng.exponential(1.0, n).cumsum()
    first = np.where(completed, arrival + rng.exponential(0.1, n), np.nan)
    finish = np.where(completed, first + rng.exponential(1.0, n), np.nan)
    gaps = GapSummary(0, {}, np.zeros(0), np.zeros(0))
    return RequestRecords(
        id=np.arange(n), replica=rng.integers(0, 3, n), arrival_s=arrival, prompt_len=rng.integers(1, 900, n),
        output_len=rng.integers(0, 3, n), completed=completed,
        reject_reason=[REASONS[k] if not c else "" for k, c in zip(rng.integers(0, 6, n).tolist(), completed)],
        num_preemptions=rng.integers(0, 2, n), first_token_s=first, finish_s=finish, itl=gaps,
        speculation=rng.integers(0, 9, (n, 4)), conversation=rng.integers(-1, 3, n),
        warmup=np.arange(n) < 2 if n > 3 else None)


def by_csv_writer(rec: RequestRecords, extra: dict) -> str:
    """What the csv module's writer makes of the same values (the code before issue 59)."""
    lat = per_request_latency(rec)
    if rec.warmup is not None and rec.warmup.any():
        extra = {**extra, "warmup": rec.warmup.astype(int).tolist()}

    def num(a):
        return ["" if x != x else f"{x:.6f}" for x in a.tolist()]

    columns = [rec.id.tolist(), rec.replica.tolist(), [f"{x:.6f}" for x in rec.arrival_s.tolist()],
               rec.prompt_len.tolist(), rec.output_len.tolist(),
               ["completed" if c else "rejected" for c in rec.completed.tolist()], rec.reject_reason,
               num(rec.first_token_s), num(rec.finish_s), num(lat["ttft"]), num(lat["tpot"]), num(lat["e2e"]),
               rec.num_preemptions.tolist(), rec.speculation[:, 0].tolist(), rec.speculation[:, 1].tolist(),
               [c if c >= 0 else "" for c in rec.conversation.tolist()], *extra.values()]
    f = io.StringIO(newline="")
    w = csv.writer(f)
    w.writerow([*HEADER, *extra])
    w.writerows(zip(*columns))
    return f.getvalue()


def test_requests_csv_is_what_the_csv_writer_writes(tmp_path):
    rng = np.random.default_rng(3)
    for n in (0, 1, 5, 400):
        rec = records(n, rng)
        odd = [None, 3, 2.5, 'say "hi", twice', "a\r\nb", "", "plain", -7]
        extra = {"itl_s": [" ".join(f"{g:.6f}" for g in rng.random(3)) for _ in range(n)],
                 "error, quoted": [odd[k % len(odd)] for k in range(n)]}
        for more in ({}, extra):
            write_requests_csv(tmp_path / "requests.csv", rec, more)
            assert (tmp_path / "requests.csv").read_bytes().decode() == by_csv_writer(rec, more), (n, list(more))
