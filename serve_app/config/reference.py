"""The config reference (docs/config-reference.md), generated from the schema's Field descriptions.

`python -m serve_app.config.reference > docs/config-reference.md`; a unit test checks the committed file is
current, so the reference cannot drift from the schema.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from serve_app.config.errors import bounds_text, literal_choices, model_class, show, unwrap_optional
from serve_app.config.schema import HeadroomConfig

HEADER = """# Config reference

Generated from the schema (`python -m serve_app.config.reference > docs/config-reference.md`); do not edit.
A config is `configs/base.yaml` with `configs/<env>.yaml` merged on top (mappings key by key, anything else
replaced, an explicit `null` clears). Unknown keys are errors; every error names the field path and what is
accepted.
"""


def _type_text(annotation: object) -> str:
    members, nullable = unwrap_optional(annotation)
    choices = literal_choices(annotation)
    if choices is not None:
        text = " \\| ".join(show(c) for c in choices)
    else:
        names = []
        for member in members:
            origin = typing.get_origin(member)
            names.append(getattr(origin or member, "__name__", str(member)))
        text = " \\| ".join(names)
    return text + (" \\| null" if nullable else "")


def _default_text(info: Any) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        return "(section defaults)"
    return "" if info.default is PydanticUndefined else show(info.default)


def _rows(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, str, str, str, str]]:
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        section = model_class(info.annotation)
        description = " ".join((info.description or "").split()).replace("|", "\\|")
        if section is not None:
            yield path, "section", _default_text(info), "", description
            yield from _rows(section, f"{path}.")
        else:
            bounds = bounds_text(info) or ""
            yield path, _type_text(info.annotation), _default_text(info), bounds, description


def render() -> str:
    lines = [HEADER, "| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for path, type_text, default, bounds, description in _rows(HeadroomConfig, ""):
        lines.append(f"| `{path}` | {type_text} | {default} | {bounds} | {description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
