"""Typed dataclasses from YAML mappings: every key, type and allowed value checked.

`build(cls, mapping)` makes a keyword-only dataclass from a mapping, refusing unknown keys (with a
"did you mean"), wrong types and values its ``validate`` rejects, in one `ConfigError` line naming
the dotted key and where it was set (`Origin`: the file, or the command-line override that set it).
The run configuration (`hpcfed.config`) and every task's and strategy's ``Config`` use it, so their
errors read the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from hpcfed.errors import ConfigError

T = TypeVar("T")


class InvalidValue(ValueError):
    """Raised by a config dataclass's ``validate``: `key` (relative to the section) has a bad value."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key} {problem}")
        self.key, self.problem = key, problem



def at_least(obj: Any, minimum: float, *names: str) -> None:
    """In a config dataclass's ``validate``: each named field, when set, is at least `minimum`."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < minimum:
            raise InvalidValue(name, f"must be >= {minimum:g}, got {value!r}")


def positive(obj: Any, *names: str) -> None:
    """In a config dataclass's ``validate``: each named field, when set, is above 0."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise InvalidValue(name, f"must be > 0, got {value!r}")


class Origin(str):
    """The config file's name, remembering which dotted keys the command line set, so that an error
    in one of those blames the command line (``Config.source`` after `load`)."""

    overrides: dict[str, str]

    def __new__(cls, source: str, overrides: dict[str, str] | None = None) -> Origin:
        obj = super().__new__(cls, source)
        obj.overrides = dict(overrides or {})
        return obj

    def override_for(self, key: str) -> str | None:
        """The override (``key=value`` as typed) that set `key` or a section holding it."""
        key = key.replace(".options.", ".")
        for set_key, item in self.overrides.items():
            if key == set_key or key.startswith(set_key + ".") or key.startswith(set_key + "["):
                return item
        return None


def locate(where: str, key: str) -> str:
    """Where a key's value came from, for an error message: ``file.yaml: key`` or
    ``command line (key=value): key``."""
    item = where.override_for(key) if isinstance(where, Origin) else None
    if item is not None:
        return f"command line ({item}): {key}"
    return f"{where}: {key}" if where else key


def build(cls: type[T], data: Any, where: str = "", prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, checking keys, types and allowed values."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_loc(where, prefix.rstrip('.') or cls.__name__)} must be a mapping, "
                          f"got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]  # T is bound to dataclasses by every caller, which the checker cannot express
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}{unknown[0]}"
        close = difflib.get_close_matches(str(unknown[0]), [k for k in fields if k != "source"], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        allowed = sorted(k for k in fields if k != "source")
        raise ConfigError(f"{_loc(where, key)}: unknown key; allowed keys here: {', '.join(allowed)}{hint}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], where, prefix + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{_loc(where, prefix + name)}: required key is missing")
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{_loc(where, prefix.rstrip('.') or cls.__name__)}: {exc}") from None
    check = getattr(obj, "validate", None)
    if callable(check):
        try:
            check()
        except InvalidValue as exc:
            raise ConfigError(f"{_loc(where, prefix + exc.key)} {exc.problem}") from None
        except ValueError as exc:
            first, _, rest = str(exc).partition(" ")
            if first in fields:  # "lr must be > 0": name the key itself, so its origin is found
                raise ConfigError(f"{_loc(where, prefix + first)} {rest}") from None
            raise ConfigError(f"{_loc(where, prefix.rstrip('.') or cls.__name__)}: {exc}") from None
    return obj


def _loc(where: str, key: str) -> str:
    return locate(where, key)


def _coerce(value: Any, hint: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if value not in args:
            choices = ", ".join(map(str, args))
            raise ConfigError(f"{_loc(where, key)} = {value!r} is not allowed; choose one of: {choices}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{_loc(where, key)}: bad value {value!r}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, where, key + ".")
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{_loc(where, key)} must be a mapping, got {value!r}")
        kt, vt = args or (Any, Any)
        return {_coerce(k, kt, where, f"{key}.{k}"): _coerce(v, vt, where, f"{key}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{_loc(where, key)} must be a list, got {value!r}")
        et = args[0] if args else Any
        items = [_coerce(v, et, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{_loc(where, key)} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                return int(value)
            raise ConfigError(f"{_loc(where, key)} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{_loc(where, key)} must be a number, got {value!r}") from None
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{_loc(where, key)} must be a string, got {value!r}")
        return str(value)
    return value


def to_plain(obj: Any) -> Any:
    """Dataclasses -> JSON-ready dicts."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj
