"""Base class for everything a user writes: unknown keys are errors, not silently ignored, and no number is
infinite or NaN (a .inf budget or rate would turn into overflows and NaN figures far from the key that caused them)."""
from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
