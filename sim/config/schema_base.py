"""Base class for everything a user writes: unknown keys are errors, not silently ignored, no number is
infinite or NaN (a .inf budget or rate would turn into overflows and NaN figures far from the key that caused them),
and no number is given as true/false (YAML reads `yes` and `on` as true, which pydantic would take as 1).
`OnUse` marks a section most scenarios leave out, whose validator is built the first time one is given."""
from functools import lru_cache
from types import UnionType
from typing import Annotated, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, TypeAdapter, model_validator
from pydantic_core import core_schema


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

# the config of a section's model validated through OnUse: nothing built at import
ON_USE = ConfigDict(defer_build=True)


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (a section's, a list's items, an Optional's)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


class OnUse:
    """`Annotated[Section | None, OnUse()]`: the field is validated by a TypeAdapter of its annotation, built the first
    time a scenario gives it (its models, with ON_USE, build nothing at import). pydantic otherwise builds every nested
    model's schema into its parent's at import, the sections no common run writes included. The checks, errors and
    key paths are the same: pydantic carries a ValidationError raised in a validator with its locations; the field's
    annotation (what the error messages and the dashboard read) is unchanged. A discriminated union of models (the
    length distributions) builds only the member a value's tag names; any other value meets the whole union."""

    def __get_pydantic_core_schema__(self, source, handler):
        adapters: dict[str | None, TypeAdapter] = {}
        key, members = _tagged_members(source)

        def adapter(tag: str | None, annotation) -> TypeAdapter:
            if tag not in adapters:
                for model in _models_in(annotation):  # their own validators and serializers too: model_dump needs them
                    model.model_rebuild()
                adapters[tag] = TypeAdapter(annotation)
            return adapters[tag]

        def validate(value):
            tag = value.get(key) if members and isinstance(value, dict) else None
            if isinstance(tag, str) and tag in members:
                return adapter(tag, Annotated[members[tag], _Tagged(key, tag)]).validate_python(value)
            return adapter(None, source).validate_python(value)

        return core_schema.no_info_plain_validator_function(validate)


def _tagged_members(annotation) -> tuple[str, dict[str, type[BaseModel]]]:
    """The discriminator of a discriminated union of models in `annotation` (an Optional's too) and its members by
    tag; ("", {}) where there is none."""
    args = get_args(annotation)
    if get_origin(annotation) is Annotated:
        key = next((m.discriminator for m in args[1:] if isinstance(getattr(m, "discriminator", None), str)), "")
        if key:
            return key, {get_args(m.model_fields[key].annotation)[0]: m for m in get_args(args[0])}
    if get_origin(annotation) in (Union, UnionType):
        return next((found for found in map(_tagged_members, args) if found[1]), ("", {}))
    return "", {}


class _Tagged:
    """One member of a discriminated union as the union validates it: refused or accepted alike, its errors located
    under its tag (pydantic's tagged union of that one choice)."""

    def __init__(self, key: str, tag: str):
        self.key, self.tag = key, tag

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.tagged_union_schema({self.tag: handler(source)}, discriminator=self.key, strict=False,
                                               from_attributes=True)
