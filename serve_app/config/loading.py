"""Loading configs: YAML files merged in order (``configs/base.yaml`` then ``configs/<env>.yaml``), validated
once into a frozen :class:`HeadroomConfig`, every problem reported with the file that set it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from serve_app.config.errors import ROOT, ConfigError, did_you_mean, dotted, explain, show, type_name
from serve_app.config.schema import HeadroomConfig

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The repository's ``configs/`` directory (``base.yaml`` plus one ``<env>.yaml`` per environment)."""


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Overlay onto base, returning a new dict; neither input is modified.

    Mappings merge key by key, recursively; anything else in the overlay (scalars, lists, a mapping over a
    scalar) replaces the base value. An explicit null in the overlay sets the value to None, e.g.
    ``speculative: null`` turns off speculation a base file configured.
    """
    merged: dict[str, Any] = {key: _copy(value) for key, value in base.items()}
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = _copy(value)
    return merged


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc,unused-ignore]
    """SafeLoader that rejects duplicate keys in a mapping (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key; the base loader reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r} (first set on line {first})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line + 1
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Reads one YAML config file: an empty file is ``{}``; anything but a mapping at the top is an error.

    Raises ConfigError naming the file, and the line and column of YAML syntax errors.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([("(file)", "file not found")], source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([("(file)", f"cannot read: {exc}")], source) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(file)"
        detail = exc.problem or exc.context or "syntax error"
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        raise ConfigError([(where, f"invalid YAML: {detail}{context}")], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("(file)", f"invalid YAML: {exc}")], source) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([(ROOT, _not_a_mapping(data))], source)
    return data


def _not_a_mapping(data: object) -> str:
    keys = ", ".join(HeadroomConfig.model_fields)
    return f"expected a mapping of settings (keys: {keys}), got a {type_name(data)}: {show(data, 40)}"


def _locate(loc: Sequence[object], layers: Sequence[tuple[str, Mapping[str, Any]]]) -> str | None:
    """The last layer whose data contains the full loc, i.e. the file that set the offending value."""
    for source, data in reversed(layers):
        node: Any = data
        for part in loc:
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            return str(source)
    return None


def _validate(data: object, layers: Sequence[tuple[str, Mapping[str, Any]]], source: str) -> HeadroomConfig:
    if not isinstance(data, Mapping):
        raise ConfigError([(ROOT, _not_a_mapping(data))], source)
    try:
        return HeadroomConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        sources: list[str] = []
        for err in exc.errors():
            for loc, message in explain(err, HeadroomConfig):
                problems.append((dotted(loc), message))
                sources.append((_locate(loc, layers) or source) if loc else source)
        raise ConfigError(problems, source, sources) from None


def parse_config(data: Mapping[str, Any], source: str = "config") -> HeadroomConfig:
    """Validates an already-merged config mapping; raises ConfigError listing every problem."""
    return _validate(data, [(source, data)] if isinstance(data, Mapping) else [], source)


def load_config(*paths: str | Path) -> HeadroomConfig:
    """Loads YAML files, merges them in order (later files win, see deep_merge) and validates the result.

    Each problem is attributed to the last file that set the offending key (or all files, joined with
    ' + ', when none did, e.g. a missing required key).
    """
    if not paths:
        raise ConfigError([(ROOT, "no config files given")])
    layers = [(str(p), load_yaml(p)) for p in paths]
    merged: dict[str, Any] = {}
    for _, data in layers:
        merged = deep_merge(merged, data)
    return _validate(merged, layers, " + ".join(source for source, _ in layers))


def load_config_files(*paths: str | Path) -> HeadroomConfig:
    """load_config, where one file that sits next to a base.yaml is an overlay on it.

    So `configs/prod.yaml` means base.yaml + prod.yaml, as `--env prod` does; several files, or base.yaml
    itself, are taken as given.
    """
    if len(paths) == 1:
        path = Path(paths[0])
        base = path.parent / "base.yaml"
        if path.name != "base.yaml" and base.is_file():
            return load_config(base, path)
    return load_config(*paths)


def available_envs(config_dir: str | Path = DEFAULT_CONFIG_DIR) -> list[str]:
    """The environments in config_dir: the names of its ``*.yaml`` files other than ``base.yaml``, sorted."""
    directory = Path(config_dir)
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.yaml") if p.stem != "base" and p.is_file())


def load_env_config(env: str, config_dir: str | Path = DEFAULT_CONFIG_DIR) -> HeadroomConfig:
    """Loads ``<config_dir>/base.yaml`` overlaid with ``<config_dir>/<env>.yaml`` (e.g. env='prod')."""
    directory = Path(config_dir)
    if not directory.is_dir():
        raise ConfigError([("(dir)", "config directory not found")], str(directory))
    envs = available_envs(directory)
    if env not in envs:
        hint = did_you_mean(env, envs)
        listed = ", ".join(envs) if envs else "none"
        msg = (
            f"unknown environment {env!r}{hint}; available environments: {listed} "
            "(the *.yaml files other than base.yaml)"
        )
        raise ConfigError([("env", msg)], str(directory))
    base = directory / "base.yaml"
    if not base.is_file():
        raise ConfigError([("(file)", "base.yaml not found; every environment overlays it")], str(base))
    return load_config(base, directory / f"{env}.yaml")
