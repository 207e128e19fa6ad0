"""What the commands print on the terminal beside their files: figures formatted alike, a console that keeps a
table's width when piped, and the real-vs-simulated table every validation prints."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def num(x) -> str:
    """A figure in four significant digits ('-' for none)."""
    return "-" if x is None else f"{x:.4g}"


def pct(x) -> str:
    """A signed percentage ('-' for none)."""
    return "-" if x is None else f"{x:+.1f}"


def wide_console() -> Console:
    """Tables piped to a file or grep keep their full width."""
    c = Console()
    return c if c.is_terminal else Console(width=200)


def print_validation(result: dict, device: str, prof, repeat: int) -> None:
    """One scenario's real vs simulated metrics (and, over several runs, the real runs' spread)."""
    spread = repeat > 1
    t = Table("metric", "real", "sim", "error %", "error % at the run's step speed",
              *(["runs", "spread %"] if spread else []))
    for name, row in result["metrics"].items():
        cells = [num(row["real"]), num(row["sim"]), pct(row["error_pct"]), pct(row.get("error_at_run_speed_pct"))]
        if spread:
            cells += [" ".join(num(v) for v in row["real_runs"]), num(row["spread_pct"])]
        t.add_row(name, *cells)
    spec = result.get("speculative")
    for name in ("tpot_p50_speedup", "throughput_speedup") if spec else ():
        row = spec[name]
        t.add_row(name, num(row["real"]), num(row["sim"]), pct(row["error_pct"]),
                  pct(row.get("error_at_run_speed_pct")), *(["", ""] if spread else []))
    if spec:
        t.add_row("alpha", num(spec["alpha_real"]), num(spec["alpha_sim"]), "", "", *(["", ""] if spread else []))
    real = "real (mean of %d executor runs)" % repeat if spread else "real"
    Console().print(f"[bold]{result['scenario']}[/] on {device}: {real} vs simulated with {prof}")
    Console().print(t)
