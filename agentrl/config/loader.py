"""Load a run config from YAML plus `dotted.key=value` overrides, and turn every mistake into one clear error.

Override rules: `a.b=v` sets an existing key (value parsed as YAML: numbers, bools, lists, null); `+a.b=v`
adds a key, allowed only inside a free-form section (a `dict[...]` field such as `envs.train` or an env's
`kwargs`). Numeric segments index lists (`reward.functions.0.weight=2`).
"""

from __future__ import annotations

import copy
import os
import sys
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from agentrl.config.errors import ConfigError
from agentrl.config.schema import MOVED_KEYS, Config


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
            if dotted in MOVED_KEYS:
                raise ConfigError(f"{dotted} moved to {MOVED_KEYS[dotted]}")
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


def packaged_examples() -> dict[str, Path]:
    """The example configs shipped in the package (`agentrl.examples`, the repo's examples/): name -> file."""
    try:
        folder = resources.files("agentrl.examples")
    except ModuleNotFoundError:  # an editable install made before the examples were packaged
        return {}
    found = {Path(entry.name).stem: Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith(".yaml")}
    return dict(sorted(found.items()))


def resolve_config_path(path: str | Path) -> Path:
    """A config argument -> the file to read: the path as given when it exists; else, for a bare name (no
    directory part, with or without .yaml), the packaged example of that name, announced on stderr; else the
    path as given (the caller reports it missing)."""
    p = Path(path)
    text = str(path)
    if p.is_file() or os.sep in text or (os.altsep and os.altsep in text):
        return p
    name = text[: -len(".yaml")] if text.endswith(".yaml") else text
    example = packaged_examples().get(name)
    if example is None:
        return p
    print(f"agentrl: using the packaged example {example}", file=sys.stderr)
    return example


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML file (or the defaults) + overrides -> validated Config; raises ConfigError on any mistake.

    `path` may also name a packaged example (`agentic_sokoban` or `agentic_sokoban.yaml`) when no such file
    exists here: see resolve_config_path."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = resolve_config_path(path)
        if not p.is_file():
            names = ", ".join(packaged_examples()) or "none installed"
            raise ConfigError(f"config file not found: {p} (packaged examples: {names})")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(_yaml_error(p, err)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    cfg = validate(raw)
    if overrides:
        full = copy.deepcopy(cfg.model_dump(by_alias=True, mode="python"))
        for key in Config.MODEL_DEFAULTS:  # unset in the file: they follow the model an override may change
            *parents, leaf = key.split(".")
            given, section = raw, full
            for name in parents:
                given, section = (given.get(name) if isinstance(given, dict) else None), section[name]
            if not isinstance(given, dict) or given.get(leaf) is None:
                section[leaf] = None
        for override in overrides:
            apply_override(full, override)
        cfg = validate(full)
    check_env_ids(cfg)
    check_model_paths(cfg)
    return cfg


def _yaml_error(path: Path, err: yaml.YAMLError) -> str:
    """`file:line:col: invalid YAML: problem (context)`, on one line like a compiler's."""
    mark = getattr(err, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    return f"{where}: invalid YAML: {problem}" + (f" ({context})" if context else "")


def check_env_ids(cfg: Config) -> None:
    """Every configured env id is registered (user modules are imported before the config is loaded)."""
    from agentrl.envs import UnknownEnvError, registered_env_ids
    from agentrl.envs.libraries import MissingLibraryError
    from agentrl.envs.registry import env_spec

    for split, envs in (("train", cfg.envs.train), ("val", cfg.envs.val)):
        for tag, env in envs.items():
            try:
                env_spec(env.env_id)
            except MissingLibraryError as err:
                raise ConfigError(f"envs.{split}.{tag}.env_id: {err}") from None
            except UnknownEnvError:
                raise ConfigError(
                    f"envs.{split}.{tag}.env_id: unknown env id {env.env_id!r} (registered: "
                    f"{', '.join(registered_env_ids())}; is the module that registers it imported? --import MOD)"
                ) from None


def _offline() -> bool:
    flags = (os.environ.get(v, "").lower() for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(f in ("1", "true", "yes", "on") for f in flags)


def check_model_path(key: str, path: str, marker: str = "config.json", revision: str | None = None) -> None:
    """`builtin:tiny`, a local Hugging Face directory (holding `marker`), or a hub id. Caught here because the
    engines and trainer would fail tens of seconds later with a long OSError. A path that looks local (absolute,
    ./, ../, ~) or exists is local; anything else is a hub id, which must be in the local cache when the hub is
    switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE); online, `check_model_loads` checks it at start-up."""
    if path.startswith("builtin:"):
        if path != "builtin:tiny":
            raise ConfigError(f"{key}: unknown builtin model {path!r} (known: builtin:tiny)")
        return
    local = Path(path).expanduser()
    if path.startswith(("/", "./", "../", "~")) or path in (".", "..") or local.exists():
        if not local.exists():
            raise ConfigError(f"{key}: {path} does not exist: {_model_path_fix(key)}")
        if not (local / marker).is_file():
            raise ConfigError(
                f"{key}: {path} is not a Hugging Face model directory (no {marker}): {_model_path_fix(key)}"
            )
        return
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        from agentrl.models.hub import hub_cache_dir, split_ref

        repo_id, pinned = split_ref(path)
        if not isinstance(try_to_load_from_cache(repo_id, marker, hub_cache_dir(), pinned or revision), str):
            raise ConfigError(f"{key}: {path!r} is no local directory, and no hub model in the local cache (offline)")


def _model_path_fix(key: str) -> str:
    if key == "model.tokenizer":
        return "set model.tokenizer to a local tokenizer folder or a hub id, or remove it to use the model's"
    return (
        f"set {key} to a local Hugging Face model folder (with config.json), a hub id such as Qwen/Qwen3-0.6B, "
        "or builtin:tiny (the built-in tiny model)"
    )


def check_model_paths(cfg: Config) -> None:
    check_model_path("model.path", cfg.model.path, revision=cfg.model.revision)
    if cfg.model.tokenizer is not None:
        check_model_path("model.tokenizer", cfg.model.tokenizer, "tokenizer_config.json")


def check_model_loads(path: str, key: str = "model.path") -> None:
    """Load the model's config.json (from the hub when online and not cached) in the driver, so that a hub id
    that cannot be fetched is one ConfigError line before any engine starts (not a long OSError in an actor)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError(f"{key}: cannot load {path!r}: {first}") from None


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(by_alias=True, mode="json"), sort_keys=False, allow_unicode=True)
