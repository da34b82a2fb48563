"""Load a run config from YAML plus `dotted.key=value` overrides, and turn every mistake into one clear error.

Override rules: `a.b=v` sets an existing key (value parsed as YAML: numbers, bools, lists, null); `+a.b=v`
adds a key, allowed only inside a free-form section (a `dict[...]` field such as `envs.train` or an env's
`kwargs`). Numeric segments index lists (`reward.functions.0.weight=2`).
"""

from __future__ import annotations

import copy
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from agentrl.config.schema import Config


class ConfigError(ValueError):
    """A config mistake, already phrased for the user (key path + what is allowed)."""


def _field_by_key(model: type[BaseModel], key: str):
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field
    return None


def _public_keys(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _unwrap(annotation: Any) -> Any:
    """Strip Optional[...] / X | None to the one real type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return annotation


def _child_type(parent: Any, key: str) -> Any:
    """Type of `parent[key]` in the schema, or None when the schema knows no such key."""
    parent = _unwrap(parent)
    if isinstance(parent, type) and issubclass(parent, BaseModel):
        field = _field_by_key(parent, key)
        return None if field is None else field.annotation
    origin = typing.get_origin(parent)
    if origin is dict:
        return typing.get_args(parent)[1]
    if origin in (list, tuple):
        return typing.get_args(parent)[0]
    return Any


def _is_model(annotation: Any) -> bool:
    annotation = _unwrap(annotation)
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_free_section(annotation: Any) -> bool:
    annotation = _unwrap(annotation)
    return annotation is Any or typing.get_origin(annotation) is dict or annotation is dict


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _schema_keys_hint(annotation: Any) -> str:
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "allowed: " + ", ".join(_public_keys(annotation))
    return ""


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `key=value` / `+key=value` to the full (defaults-filled) config dict in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value (or +key=value to add a key)")
    raw_key, raw_value = override.split("=", 1)
    adding = raw_key.startswith("+")
    path = raw_key.lstrip("+").strip().split(".")
    if not all(path):
        raise ConfigError(f"override {override!r}: empty key segment")
    value = _parse_value(raw_value)

    node: Any = data
    annotation: Any = Config
    for depth, key in enumerate(path):
        dotted = ".".join(path[: depth + 1])
        last = depth == len(path) - 1
        parent_annotation = annotation
        annotation = _child_type(parent_annotation, key)
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"{dotted}: no list item {key} (the list has {len(node)} items)")
            key_obj: Any = int(key)
            exists = True
        elif isinstance(node, dict):
            key_obj = key
            exists = key in node
        else:
            raise ConfigError(f"{dotted}: {'.'.join(path[:depth])} is a value, not a section")

        if annotation is None:
            hint = _schema_keys_hint(parent_annotation)
            raise ConfigError(f"{dotted}: unknown key" + (f" ({hint})" if hint else ""))
        known_field = _is_model(parent_annotation)  # a schema field with a default, absent from the data
        if not exists and not known_field:
            if not (adding and last):
                if _is_free_section(parent_annotation):
                    raise ConfigError(
                        f"{dotted}: no such entry; use +{dotted}=... to add a new key to this free-form section"
                    )
                raise ConfigError(f"{dotted}: unknown key")
            if not _is_free_section(parent_annotation):
                raise ConfigError(
                    f"+{dotted}: section {'.'.join(path[:depth]) or '<root>'} does not take new keys "
                    f"({_schema_keys_hint(parent_annotation)})"
                )
        elif exists and adding and last:
            raise ConfigError(f"+{dotted}: key already exists; set it without the leading +")
        if last:
            node[key_obj] = value
        else:
            if node.get(key_obj) is None if isinstance(node, dict) else node[key_obj] is None:
                node[key_obj] = {}
            node = node[key_obj]


def _format_loc(loc: tuple) -> str:
    parts = []
    for item in loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif item in ("function-after", "function-before") or str(item).startswith(("function-", "tagged-")):
            continue
        else:
            parts.append(str(item))
    return ".".join(parts) or "<root>"


def _format_validation_error(err: ValidationError) -> ConfigError:
    lines = []
    for item in err.errors():
        loc = _format_loc(item["loc"])
        if item["type"] == "extra_forbidden":
            parent: Any = Config
            for key in item["loc"][:-1]:
                parent = _child_type(parent, str(key)) if not isinstance(key, int) else _child_type(parent, "0")
            hint = _schema_keys_hint(parent) if parent is not None else ""
            lines.append(f"{loc}: unknown key" + (f" ({hint})" if hint else ""))
        else:
            got = item.get("input")
            got_text = "" if isinstance(got, dict | list) else f" (got {got!r})"
            msg = item["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}{got_text}")
    return ConfigError("; ".join(lines))


def validate(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise _format_validation_error(err) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML file (or the defaults) + overrides -> validated Config; raises ConfigError on any mistake."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{p}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    cfg = validate(raw)
    if not overrides:
        return cfg
    full = copy.deepcopy(cfg.model_dump(by_alias=True, mode="python"))
    for override in overrides:
        apply_override(full, override)
    return validate(full)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(by_alias=True, mode="json"), sort_keys=False, allow_unicode=True)
