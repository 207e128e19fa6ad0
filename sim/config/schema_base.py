"""Base class for everything a user writes: unknown keys are errors, not silently ignored."""
from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
