"""Config errors that say how to fix them: the field path, the value given and the values accepted.

``ConfigError`` carries every problem found at once; validators raise ``FieldProblems`` (or any ValueError
with a ``problems`` list of ``(relative path, message)`` pairs, as autoscale's settings do) to report several
problems with their paths; :func:`explain` turns pydantic's error dicts into such messages, e.g.::

    configs/prod.yaml: engine.max_num_seq: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?); ...
    configs/prod.yaml: engine.gpu_memory_utilization: must be between 0.05 and 0.99, got 1.5
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel

from serve_app.config.vocabulary import APP_NAME_HINT, APP_NAME_PATTERN, SERVED_NAME_HINT, SERVED_NAME_PATTERN

ROOT = "(top level)"
_PATTERN_HINTS = {SERVED_NAME_PATTERN: SERVED_NAME_HINT, APP_NAME_PATTERN: APP_NAME_HINT}


class ConfigError(ValueError):
    """A configuration that cannot be used, with every problem found.

    ``problems`` is a list of ``(field path, message)`` pairs, the path dotted (``engine.speculative.method``)
    or a location in a file (``line 3, column 7``). ``str(err)`` prints one line per problem,
    ``"<source>: <path>: <message>"``, where source is the file that set the offending value when it is
    known, else the ``source`` given (the file names joined with ``+``, or ``config``).
    """

    def __init__(
        self,
        problems: Sequence[tuple[str, str]],
        source: str = "config",
        sources: Sequence[str] | None = None,
    ) -> None:
        self.problems: list[tuple[str, str]] = [(str(p), str(m)) for p, m in problems]
        self.source = source
        if sources is not None and len(sources) != len(self.problems):
            raise ValueError("sources must have one entry per problem")
        self.sources: list[str] = list(sources) if sources is not None else [source] * len(self.problems)
        super().__init__(self._render())

    def _render(self) -> str:
        return "\n".join(
            f"{src}: {path}: {msg}" for src, (path, msg) in zip(self.sources, self.problems, strict=True)
        )

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems, self.source, self.sources))


class FieldProblems(ValueError):
    """Raised by validators: ``(path relative to the validated model, message)`` pairs, all reported."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in problems))


def raise_if(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise FieldProblems(problems)


def choices(values: Iterable[object]) -> str:
    return ", ".join(show(v) for v in values)


_EXPECTED_TYPE = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
}
_RANGE_ERRORS = {  # pydantic error type -> (comparison, ctx key)
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def show(value: object, limit: int = 80) -> str:
    """A value as it would look in YAML, shortened: null, true, 1.5, 'text', {...}, [...]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        text = str(int(value))
    elif isinstance(value, (int, float, str)):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unwrap_optional(annotation: object) -> tuple[list[object], bool]:
    """The non-None members of an annotation and whether None is accepted."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        members = list(typing.get_args(annotation))
        nullable = type(None) in members
        return [m for m in members if m is not type(None)], nullable
    return [annotation], False


def model_class(annotation: object) -> type[BaseModel] | None:
    for member in unwrap_optional(annotation)[0]:
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def literal_choices(annotation: object) -> tuple[object, ...] | None:
    for member in unwrap_optional(annotation)[0]:
        if typing.get_origin(member) is Literal:
            return typing.get_args(member)
    return None


def _walk(root: type[BaseModel], loc: Sequence[object]) -> tuple[type[BaseModel] | None, Any]:
    """The model class owning the last element of loc and that element's FieldInfo (None when unknown)."""
    owner: type[BaseModel] | None = root
    info = None
    for i, part in enumerate(loc):
        if owner is None or not isinstance(part, str) or part not in owner.model_fields:
            return (owner if i == len(loc) - 1 else None), None
        info = owner.model_fields[part]
        if i < len(loc) - 1:
            owner = model_class(info.annotation)
    return owner, info


def _section_at(root: type[BaseModel], loc: Sequence[object]) -> type[BaseModel] | None:
    """The model class validated at loc (the root for an empty loc)."""
    if not loc:
        return root
    _, info = _walk(root, loc)
    return model_class(info.annotation) if info is not None else None


def _field_homes(root: type[BaseModel], prefix: str = "") -> dict[str, list[str]]:
    """Every field name in the tree mapped to the dotted paths where it lives."""
    homes: dict[str, list[str]] = {}
    for name, info in root.model_fields.items():
        path = f"{prefix}{name}"
        homes.setdefault(name, []).append(path)
        sub = model_class(info.annotation)
        if sub is not None:
            for key, paths in _field_homes(sub, f"{path}.").items():
                homes.setdefault(key, []).extend(paths)
    return homes


def bounds_text(info: Any) -> str | None:
    """'between 0.05 and 0.99', '> 0 and <= 600000', '>= 0' from a field's annotated_types metadata."""
    lower: tuple[str, Any] | None = None
    upper: tuple[str, Any] | None = None
    for meta in getattr(info, "metadata", ()):
        if isinstance(meta, annotated_types.Ge):
            lower = (">=", meta.ge)
        elif isinstance(meta, annotated_types.Gt):
            lower = (">", meta.gt)
        elif isinstance(meta, annotated_types.Le):
            upper = ("<=", meta.le)
        elif isinstance(meta, annotated_types.Lt):
            upper = ("<", meta.lt)
    if lower and upper:
        if lower[0] == ">=" and upper[0] == "<=":
            return f"between {show(lower[1])} and {show(upper[1])}"
        return f"{lower[0]} {show(lower[1])} and {upper[0]} {show(upper[1])}"
    if lower:
        return f"{lower[0]} {show(lower[1])}"
    if upper:
        return f"{upper[0]} {show(upper[1])}"
    return None


def _first_sentence(text: str | None) -> str:
    if not text:
        return ""
    sentence = re.split(r"(?<=\.)\s", text.strip(), maxsplit=1)[0]
    return sentence[:1].lower() + sentence[1:].rstrip(".")


def did_you_mean(given: object, options: Iterable[object]) -> str:
    """' (did you mean 'x'?)' for the closest option, or '' when none is close."""
    if not isinstance(given, str):
        return ""
    texts = {str(o): o for o in options}
    match = difflib.get_close_matches(given, list(texts), n=1, cutoff=0.6)
    if not match:
        lowered = {k.lower(): k for k in texts}
        if given.lower() in lowered:
            match = [lowered[given.lower()]]
    return f" (did you mean {show(texts[match[0]])}?)" if match else ""


def _got(value: object) -> str:
    """'got 5 (integer)', or 'got null'."""
    return "got null" if value is None else f"got {show(value)} ({type_name(value)})"


@dataclass(frozen=True)
class _Failure:
    """One pydantic error, with the field it concerns looked up in the schema."""

    etype: str
    loc: tuple[Any, ...]
    given: Any
    ctx: Mapping[str, Any]
    msg: str
    root: type[BaseModel]
    info: Any  # the FieldInfo at loc, None when loc names no field

    @property
    def annotation(self) -> object:
        return getattr(self.info, "annotation", None)

    @property
    def or_null(self) -> str:
        nullable = self.info is not None and unwrap_optional(self.annotation)[1]
        return " or null" if nullable else ""

    @property
    def literal_choices(self) -> tuple[object, ...] | None:
        return literal_choices(self.annotation) if self.info is not None else None


def explain(err: Mapping[str, Any], root: type[BaseModel]) -> list[tuple[tuple[Any, ...], str]]:
    """Turns one pydantic error dict into (loc, message) pairs; see the module docstring for the style."""
    loc: tuple[Any, ...] = tuple(err.get("loc", ()))
    etype: str = err["type"]
    if etype == "value_error":
        return _value_error(loc, err)
    if etype == "extra_forbidden":
        return [(loc, _unknown_key(loc, err.get("input"), root))]
    _, info = _walk(root, loc)
    f = _Failure(etype, loc, err.get("input"), err.get("ctx") or {}, err.get("msg", etype), root, info)
    for kinds, describe in _DESCRIBERS:
        if etype in kinds:
            return [(loc, describe(f))]
    return [(loc, f"{f.msg}, got {show(f.given)}")]


def _value_error(loc: tuple[Any, ...], err: Mapping[str, Any]) -> list[tuple[tuple[Any, ...], str]]:
    cause = (err.get("ctx") or {}).get("error")
    problems = getattr(cause, "problems", None)
    if isinstance(cause, ValueError) and isinstance(problems, list):
        return [(loc + tuple(path.split(".")), msg) for path, msg in problems]
    return [(loc, re.sub(r"^Value error, ", "", err.get("msg", str(cause))))]


def _unknown_key(loc: tuple[Any, ...], given: object, root: type[BaseModel]) -> str:
    owner = _section_at(root, loc[:-1])
    key = loc[-1] if loc else given
    allowed = sorted(owner.model_fields) if owner is not None else []
    hint = did_you_mean(key, allowed)
    if not hint and isinstance(key, str):
        homes = [p for p in _field_homes(root).get(key, []) if p != ".".join(map(str, loc))]
        if homes:
            hint = f" ('{key}' belongs at {' or '.join(homes)})"
    return f"unknown key {show(key)}{hint}; allowed keys here: {', '.join(allowed)}"


def _missing(f: _Failure) -> str:
    if f.literal_choices is not None:
        return f"required key is missing; one of: {choices(f.literal_choices)}"
    what = _first_sentence(getattr(f.info, "description", None))
    section = model_class(f.annotation)
    if section is not None:
        keys = ", ".join(sorted(section.model_fields))
        what = f"{what}; a mapping with keys: {keys}" if what else f"a mapping with keys: {keys}"
    return "required key is missing" + (f" ({what})" if what else "")


def _not_a_choice(f: _Failure) -> str:
    options = f.literal_choices
    accepted = choices(options) if options is not None else str(f.ctx.get("expected", "?"))
    return f"must be one of {accepted}{f.or_null}, got {show(f.given)}{did_you_mean(f.given, options or ())}"


def _out_of_range(f: _Failure) -> str:
    bound_text = bounds_text(f.info)
    if bound_text is None:  # no metadata found: fall back to the one bound pydantic reports
        symbol, ctx_key = _RANGE_ERRORS[f.etype]
        bound_text = f"{symbol} {show(f.ctx.get(ctx_key))}"
    return f"must be {bound_text}, got {show(f.given)}"


def _wrong_type(f: _Failure) -> str:
    section = model_class(f.annotation) if f.info is not None else (f.root if not f.loc else None)
    if section is not None:
        expected = (
            f"a mapping of {'.'.join(map(str, f.loc)) or 'top-level'} settings "
            f"(keys: {', '.join(sorted(section.model_fields))})"
        )
    elif f.literal_choices is not None:
        expected = f"one of {choices(f.literal_choices)}"
    else:
        expected = _EXPECTED_TYPE[f.etype]
        bound_text = bounds_text(f.info)
        if bound_text is not None:
            expected += f" {bound_text}"
    return f"expected {expected}{f.or_null}, {_got(f.given)}"


def _bad_pattern(f: _Failure) -> str:
    pattern = str(f.ctx.get("pattern", ""))
    rule = _PATTERN_HINTS.get(pattern, f"must match {pattern}")
    return f"got {show(f.given)}, which is not allowed: {rule} (pattern {pattern})"


def _too_short(f: _Failure) -> str:
    if f.ctx.get("min_length") == 1:
        return f"must be a non-empty string{f.or_null}, got {show(f.given)}"
    return f"must be at least {f.ctx.get('min_length')} characters, got {show(f.given)}"


def _too_long(f: _Failure) -> str:
    return f"must be at most {f.ctx.get('max_length')} characters, got {len(str(f.given))} characters"


_DESCRIBERS: tuple[tuple[Container[str], Callable[[_Failure], str]], ...] = (
    (("invalid_key",), lambda f: f"keys must be strings, {_got(f.given)}"),
    (("missing",), _missing),
    (("literal_error",), _not_a_choice),
    (_RANGE_ERRORS, _out_of_range),
    (_EXPECTED_TYPE, _wrong_type),
    (("string_pattern_mismatch",), _bad_pattern),
    (("string_too_short",), _too_short),
    (("string_too_long",), _too_long),
)


def dotted(loc: Sequence[object]) -> str:
    return ".".join(str(part) for part in loc) or ROOT
