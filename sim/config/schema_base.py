"""Base class for everything a user writes: unknown keys are errors, not silently ignored, no number is
infinite or NaN (a .inf budget or rate would turn into overflows and NaN figures far from the key that caused them),
and no number is given as true/false (YAML reads `yes` and `on` as true, which pydantic would take as 1)."""
from functools import lru_cache
from types import UnionType
from typing import Annotated, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator


@lru_cache(maxsize=None)
def _wants_number(cls: type, name: str) -> bool:
    """Whether field `name` of `cls` takes an int or a float and not a bool."""
    kinds, todo = set(), [cls.model_fields[name].annotation]
    while todo:
        a = todo.pop()
        if get_origin(a) is Annotated:
            todo.append(get_args(a)[0])
        elif get_origin(a) in (Union, UnionType):
            todo.extend(get_args(a))
        else:
            kinds.add(a)
    return bool(kinds & {int, float}) and bool not in kinds


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data):
        """A true/false where a number goes becomes the text "true"/"false", which the field's own type check
        then refuses at its key (a field validator cannot run before a discriminated union's tag)."""
        if isinstance(data, dict):
            bools = {k: str(v).lower() for k, v in data.items()
                     if isinstance(v, bool) and isinstance(k, str) and k in cls.model_fields and _wants_number(cls, k)}
            if bools:
                return {**data, **bools}
        return data
