"""Building a `Config` from defaults, a YAML or TOML file and ``--set a.b=value`` overrides.

An invalid value is one line naming the field and the argument that gave it. Also the config
reference of docs/config.md, generated from the models.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from diloco_p2p.config.tree import Config
from diloco_p2p.errors import UserError


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; pass an existing YAML or TOML file to --config")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"config file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {_one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse one ``a.b=value``; the value is read as YAML so numbers, booleans and lists work."""
    if "=" not in item:
        raise UserError(f"--set {item!r} has no '='; write it as --set section.field=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise UserError(f"--set {item!r} has an empty field name; write it as --set section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_override(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build the config from defaults, then the file (if any), then ``--set`` overrides.

    An invalid value is attributed to the ``--set`` argument that gave it, else to the file."""
    tree, sources = config_tree(path, overrides)
    return validate_config(tree, source=str(path) if path else "config", sources=sources)


def config_tree(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                ) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """The tree of the file (if any) with ``--set`` overrides applied, not yet validated, and the
    argument that set each overridden field (`validate_config`'s `sources`)."""
    tree: dict[str, Any] = _read_file(Path(path)) if path else {}
    sources: dict[tuple[str, ...], str] = {}
    for item in overrides:
        keys, value = parse_override(item)
        apply_override(tree, keys, value)
        sources[tuple(keys)] = f"--set {item}"
    return tree, sources


def validate_config(tree: dict[str, Any], source: str = "config",
                    sources: dict[tuple[str, ...], str] | None = None) -> Config:
    """`Config` from a tree, or `UserError` naming the field and where its value came from:
    `source`, unless `sources` (a field path -> the argument that set it) covers the field."""
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        where = ".".join(loc) or "(top level)"
        source = _source_of(loc, sources or {}, source)
        if err["type"] == "extra_forbidden":
            raise UserError(
                f"{source}: unknown field {where!r}; check the spelling against the config reference in docs/config.md"
            ) from None
        raise UserError(f"{source}: field {where!r}: {err['msg']} (got {err.get('input')!r})") from None


def _source_of(loc: tuple[str, ...], sources: dict[tuple[str, ...], str], default: str) -> str:
    """The last ``--set`` that gave the field at `loc`, a value inside it, or the section holding it
    (a cross-field check fails on the section); else `default`."""
    hits = [arg for keys, arg in sources.items() if keys[:len(loc)] == loc or loc[:len(keys)] == keys]
    return hits[-1] if hits else default


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def config_reference() -> str:
    """The config reference of docs/config.md, generated from the models so it cannot drift."""
    lines = ["| field | default | description |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = info.default_factory() if info.default_factory else info.default
            shown = json.dumps(default) if default is not None else "unset"
            lines.append(f"| `{prefix}{name}` | `{shown}` | {info.description} |")

    walk(Config, "")
    return "\n".join(lines)
