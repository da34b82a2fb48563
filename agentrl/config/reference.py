"""The config reference, generated from the pydantic schema (the docs site's `reference/config.md`): every key
with its type, default, allowed values and description, so the reference cannot drift from the code."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from agentrl.config.schema import Config


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds (directly, in a list or as dict values, or in a union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return ""
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return json.dumps(to_jsonable_python(value), default=str)


def _bounds(field: Any) -> str:
    """ge / gt / le / lt constraints of a field, as text (`>= 0`)."""
    marks = []
    for meta in field.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                marks.append(f"{op} {getattr(meta, attr)}")
    return ", ".join(marks)


def _section_doc(annotation: Any) -> str:
    """A section's own docstring, first paragraph (its rows then follow)."""
    for model in _models_in(annotation):
        doc = model.__doc__ or ""
        if doc and not doc.startswith(("Usage docs", "!!!")) and model.__doc__ != BaseModel.__doc__:
            return " ".join(doc.split("\n\n")[0].split())
    return ""


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every key path of the config (`trainer.optim.lr`), with its pydantic field. A dict of sections (env tags,
    tool sets) is entered as `<tag>`; a list of sections as `[]`."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        yield key, field
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        for sub in _models_in(annotation):
            child = {dict: f"{key}.<name>.", list: f"{key}[]."}.get(origin, f"{key}.")
            yield from config_keys(sub, child)


def config_reference() -> str:
    """The whole reference as Markdown: one table per top-level section."""
    lines = [
        "# Config reference",
        "",
        "Generated from `agentrl/config/schema.py` when the docs are built: every key of the one YAML file, its type,",
        "default and meaning. Override any of them on the command line as `key.path=value`",
        "(`agentrl config show CONFIG` prints a config with every default filled in).",
        "",
    ]
    section = None
    for key, field in config_keys():
        top = key.split(".")[0].split("[")[0] if "." in key or _models_in(field.annotation) else "top level"
        if top != section:
            section = top
            title = "Top level" if top == "top level" else f"`{top}`"
            lines += ["", f"## {title}", "", "| key | type | default | description |", "|---|---|---|---|"]
        desc = field.description or _section_doc(field.annotation)
        desc = desc.replace("|", "\\|").replace("\n", " ")
        bounds = _bounds(field)
        if bounds:
            desc = f"{desc} ({bounds})" if desc else bounds
        type_name = _type_name(field.annotation)
        default = _default(field).replace("|", "\\|")
        lines.append(f"| `{key}` | `{type_name}` | `{default}` | {desc} |")
    return "\n".join(lines) + "\n"
