"""`infersim distill`, `infersim train-medusa` and `infersim train-eagle`: speculative decoding's drafters trained on
SmolLM2-135M's own generations (a small draft model; Medusa-1 heads and their candidate tree; an EAGLE head and its chain or
tree). The executor's modules (torch) are imported inside."""
from __future__ import annotations

from pathlib import Path

from sim.config.errors import ConfigError


def distill(out: Path | None, layers: list[int], vocab_size: int, minutes: float, max_new: int,
            threads: int | None) -> None:
    """Distill SmolLM2-135M into a small draft model (speculative method draft_model)."""
    from executor.training.speculative import distill_command

    try:
        distill_command(out, layers, vocab_size, minutes, max_new, threads)
    except ValueError as e:
        raise ConfigError(str(e), "--layers") from None


def train_medusa(out: Path | None, num_heads: int, vocab_size: int, minutes: float, max_new: int,
                 threads: int | None, profile: Path | None, retree: bool = False) -> None:
    """Train Medusa-1 heads on SmolLM2-135M's generations and pick their tree (`retree`: only pick the tree)."""
    from calibration.validate import PROFILES
    from executor.training.speculative import retree_command, train_medusa_command

    profile = profile or PROFILES / "cpu.json"
    if retree:
        try:
            retree_command(out, profile)
        except FileNotFoundError as e:
            raise ConfigError(str(e), "--out") from None
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # a medusa.json not as trained
            raise ConfigError(f"medusa.json there is not what `infersim train-medusa` writes ({type(e).__name__}: "
                              f"{str(e)[:80]})", "--out", None if out is None else str(out)) from None
        return
    train_medusa_command(out, num_heads, vocab_size, minutes, max_new, threads, profile)


def train_eagle(out: Path | None, vocab_size: int, minutes: float, max_new: int, threads: int | None,
                profile: Path | None, steps: int) -> None:
    """Train an EAGLE head on SmolLM2-135M's generations and pick its chain or tree (speculative method eagle)."""
    from calibration.validate import PROFILES
    from executor.training.eagle import train_eagle_command

    train_eagle_command(out, vocab_size, minutes, max_new, threads, profile or PROFILES / "cpu.json", steps)
