"""What the dashboard's widgets offer, read from the scenario's pydantic schema: a field's choices (its Literal
values) and its default, so that a widget never states a default or a choice list of its own."""
from __future__ import annotations

from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel


def default(model: type[BaseModel], name: str) -> Any:
    """The schema's default of `model.name`."""
    return model.model_fields[name].default


def choices(model: type[BaseModel], name: str, exclude: tuple = ()) -> list:
    """The values a Literal field of `model` allows (None and `exclude` left out), in the schema's order."""
    return [v for v in _literals(model.model_fields[name].annotation) if v is not None and v not in exclude]


def upper(model: type[BaseModel], name: str) -> int | float | None:
    """The schema's upper bound (`le`) on `model.name`, None if it has none."""
    return next((m.le for m in model.model_fields[name].metadata if getattr(m, "le", None) is not None), None)


def _literals(annotation) -> list:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if get_origin(annotation) is Union or type(annotation).__name__ == "UnionType":
        return [v for arg in get_args(annotation) for v in _literals(arg)]
    return []
