"""Building typed dataclass trees from plain mappings (YAML) with every problem reported at once.

Supports the field types configs here use: bool, int, float, str, ``X | None``, ``list[X]``, ``tuple[X, ...]``,
``dict[str, X]`` / ``dict[str, Any]`` and nested dataclasses. Strings given for numbers (from a command line, or
YAML's ``3e-4`` which is a string in YAML 1.1) are converted. Unknown keys get a did-you-mean suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["build", "to_plain", "suggest"]

_MISSING = object()


def suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(options))}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def convert(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    """``value`` as type ``tp``; on failure append a message naming ``path`` and return ``_MISSING``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        sub: list[str] = []
        for a in inner:
            out = convert(value, a, path, sub)
            if out is not _MISSING:
                return out
        errors.append(f"{path}: {value!r} is not {' or '.join(_type_name(a) for a in args)}")
        return _MISSING
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            errors.append(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
            return _MISSING
        return build(tp, value, path, errors)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, list | tuple):
            errors.append(f"{path}: expected a list, got {value!r}")
            return _MISSING
        item_tp = args[0] if args else Any
        items = [convert(v, item_tp, f"{path}[{i}]", errors) for i, v in enumerate(value)]
        return _MISSING if any(i is _MISSING for i in items) else (tuple(items) if origin is tuple else items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            errors.append(f"{path}: expected a mapping, got {value!r}")
            return _MISSING
        args = typing.get_args(tp)
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): convert(v, val_tp, f"{path}.{k}", errors) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        errors.append(f"{path}: expected true or false, got {value!r}")
        return _MISSING
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
                if f.is_integer():
                    return int(f)
            except ValueError:
                pass
        errors.append(f"{path}: expected an integer, got {value!r}")
        return _MISSING
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        errors.append(f"{path}: expected a number, got {value!r}")
        return _MISSING
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        errors.append(f"{path}: expected a string, got {value!r}")
        return _MISSING
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    errors.append(f"{path}: cannot use {value!r} as {_type_name(tp)}")
    return _MISSING


def build(cls: type, data: Mapping[str, Any], path: str, errors: list[str]) -> Any:
    """An instance of dataclass ``cls`` from ``data``; problems (including ``__post_init__`` ones) go to ``errors``."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            errors.append(f"{path}.{key}: unknown key{suggest(key, list(fields))}".lstrip("."))
    kwargs = {}
    before = len(errors)
    for name in fields:
        if name in data:
            value = convert(data[name], hints[name], f"{path}.{name}".lstrip("."), errors)
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
    """Dataclasses to dicts, tuples to lists: a JSON/YAML-ready copy."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_plain(v) for v in obj]
    return obj
