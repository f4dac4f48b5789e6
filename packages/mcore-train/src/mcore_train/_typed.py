"""Building typed dataclass trees from plain mappings (YAML) with every problem reported at once.

Supports the field types configs here use: bool, int, float, str, ``Literal[...]`` choices, ``X | None``,
``list[X]``, ``tuple[X, ...]``, ``dict[str, X]`` / ``dict[str, Any]`` and nested dataclasses. Strings given for
numbers (from a command line, or YAML's ``3e-4`` which is a string in YAML 1.1) are converted. Unknown keys get a
did-you-mean suggestion; a value outside a ``Literal``'s choices is reported with the choices, here and nowhere else.

A nested dataclass field marked with :func:`inline` is a component's own config kept whole inside a section, its
fields read and written as keys of the section itself (``parallel.bucket_size`` for the ``DDPConfig`` inside the
parallel section).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["build", "convert", "inline", "to_plain", "suggest"]

_MISSING = object()
_INLINE = "mcore_train.inline"


def suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(options))}"


def inline(exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field metadata of a nested dataclass whose fields are keys of the enclosing section; ``exclude`` names its
    fields that are not keys (the program fills them in, e.g. from another section)."""
    return {_INLINE: frozenset(exclude)}


def _inline_keys(f: dataclasses.Field[Any], tp: Any) -> list[str] | None:
    """The keys an inline field contributes to its section (None when ``f`` is an ordinary field)."""
    if _INLINE not in f.metadata:
        return None
    return [g.name for g in dataclasses.fields(tp) if g.init and g.name not in f.metadata[_INLINE]]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _union(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    if len(inner) == 1 and (typing.get_origin(inner[0]) is typing.Literal or dataclasses.is_dataclass(inner[0])):
        return convert(value, inner[0], path, errors)  # its own messages (choices, unknown keys), not "is not X"
    for a in inner:
        out = convert(value, a, path, [])
        if out is not _MISSING:
            return out
    errors.append(f"{path}: {value!r} is not {' or '.join(_type_name(a) for a in args)}")
    return _MISSING


def _spelt(choice: Any) -> str:
    """A choice as it is written in YAML or on the command line (``true``, not ``True``)."""
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def _choice(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    choices = typing.get_args(tp)
    for c in choices:
        if (type(value) is type(c) and value == c) or (isinstance(value, str) and value in (str(c), _spelt(c))):
            return c
    errors.append(f"{path}={value!r} must be one of {', '.join(_spelt(c) for c in choices)}")
    return _MISSING


def _sequence(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    args = typing.get_args(tp)
    if isinstance(value, str):
        value = [v for v in value.replace(",", " ").split() if v]
    if not isinstance(value, list | tuple):
        errors.append(f"{path}: expected a list, got {value!r}")
        return _MISSING
    item_tp = args[0] if args else Any
    items = [convert(v, item_tp, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if any(i is _MISSING for i in items):
        return _MISSING
    return tuple(items) if typing.get_origin(tp) is tuple else items


def _mapping(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(value, Mapping):
        errors.append(f"{path}: expected a mapping, got {value!r}")
        return _MISSING
    args = typing.get_args(tp)
    val_tp = args[1] if len(args) == 2 else Any
    return {str(k): convert(v, val_tp, f"{path}.{k}", errors) for k, v in value.items()}


def _bool(value: Any, path: str, errors: list[str]) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
        return value.lower() in ("true", "yes", "1", "on")
    errors.append(f"{path}: expected true or false, got {value!r}")
    return _MISSING


def _number(value: Any, path: str, errors: list[str], integer: bool) -> Any:
    """A float, or with ``integer`` an int, from a number or a numeric string (``3e-4``, ``100_000``); an integer
    must have no fractional part."""
    if integer and isinstance(value, int) and not isinstance(value, bool):
        return value
    number = value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value.replace("_", ""))
    if isinstance(number, int | float) and not isinstance(number, bool):
        if not integer:
            return float(number)
        if float(number).is_integer():
            return int(number)
    errors.append(f"{path}: expected {'an integer' if integer else 'a number'}, got {value!r}")
    return _MISSING


def _str(value: Any, path: str, errors: list[str]) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    errors.append(f"{path}: expected a string, got {value!r}")
    return _MISSING


_SCALARS: dict[Any, Callable[[Any, str, list[str]], Any]] = {
    bool: _bool,
    int: functools.partial(_number, integer=True),
    float: functools.partial(_number, integer=False),
    str: _str,
}


def convert(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    """``value`` as type ``tp``; on failure append a message naming ``path`` and return ``_MISSING``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(value, tp, path, errors)
    if origin is typing.Literal:
        return _choice(value, tp, path, errors)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            errors.append(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
            return _MISSING
        return build(tp, value, path, errors)
    if origin in (list, tuple):
        return _sequence(value, tp, path, errors)
    if origin is dict or tp is dict:
        return _mapping(value, tp, path, errors)
    if tp in _SCALARS:
        return _SCALARS[tp](value, path, errors)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    errors.append(f"{path}: cannot use {value!r} as {_type_name(tp)}")
    return _MISSING


def build(cls: type, data: Mapping[str, Any], path: str, errors: list[str]) -> Any:
    """An instance of dataclass ``cls`` from ``data``; problems (including ``__post_init__`` ones) go to ``errors``."""
    hints = typing.get_type_hints(cls)
    own: list[str] = []
    nested: dict[str, list[str]] = {}  # inline field -> the keys of the section that are its fields
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        keys = _inline_keys(f, hints[f.name])
        if keys is None:
            own.append(f.name)
        else:
            nested[f.name] = keys
    known = own + [k for keys in nested.values() for k in keys]
    for key in data:
        if key not in known:
            errors.append(f"{path}.{key}: unknown key{suggest(key, known)}".lstrip("."))
    kwargs = {}
    before = len(errors)
    for name in own:
        if name in data:
            value = convert(data[name], hints[name], f"{path}.{name}".lstrip("."), errors)
            if value is not _MISSING:
                kwargs[name] = value
    for name, keys in nested.items():
        value = build(hints[name], {k: data[k] for k in keys if k in data}, path, errors)
        if value is not _MISSING:
            kwargs[name] = value
    if len(errors) > before:
        return _MISSING
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        problems = getattr(e, "problems", None) or [str(e)]
        errors.extend(f"{path or cls.__name__}: {p}" for p in problems)
        return _MISSING


def to_plain(obj: Any) -> Any:
    """Dataclasses to dicts (inline fields merged into their section), tuples to lists: a JSON/YAML-ready copy."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = to_plain(getattr(obj, f.name))
            if _INLINE in f.metadata:
                out.update({k: v for k, v in value.items() if k not in f.metadata[_INLINE]})
            else:
                out[f.name] = value
        return out
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_plain(v) for v in obj]
    return obj
