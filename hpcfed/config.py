"""Typed run configuration: YAML + ``key=value`` overrides -> validated dataclasses.

Every section is a keyword-only dataclass. `build` checks unknown keys, types and allowed values and
raises `ConfigError` naming the dotted key (``federation.quorum``), the file, and what is allowed.
Task and strategy sections are free-form here; each task/strategy validates its own keys with
`build` on its own ``Config`` dataclass, so their errors read the same way (``task.lr``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or malformed; the message names the key."""


@dataclass(kw_only=True)
class FederationConfig:
    """How the server drives clients."""

    mode: Literal["sync", "async"] = "sync"
    num_clients: int | None = None  # default: MPI world size - 1; must match it when given
    quorum: float = 1.0  # fraction of clients whose update closes a sync round
    round_deadline_s: float = 600.0  # a sync round closes at the deadline if the quorum is met
    client_timeout_s: float = 900.0  # a client gives up on a silent server after this
    setup_timeout_s: float = 300.0
    max_updates: int | None = None  # async: total accepted uploads before stopping (default rounds*K)
    slowdown: dict[int, float] = field(default_factory=dict)  # client_id -> factor (straggler knob)
    on_client_failure: Literal["abort", "continue"] = "abort"
    status_every_s: float = 30.0


@dataclass(kw_only=True)
class SecurityConfig:
    """Secure channel credentials (see README, "Security")."""

    mode: Literal["psk", "keys"] = "psk"
    psk_env: str = "HPCFED_PSK"  # env var holding the pre-shared key (hex); `hpcfed run --np` sets one
    psk_file: str | None = None
    identity: str | None = None  # keys mode: this rank's Ed25519 key; "{rank}" and "{client_id}" expand
    authorized_keys: str | None = None  # keys mode, server: file of allowed site public keys
    server_public_key: str | None = None  # keys mode, clients: the server's public key file
    max_rejects: int = 10000  # a peer is cut off after this many rejected messages


@dataclass(kw_only=True)
class CommConfig:
    chunk_bytes: int = 4 << 20
    max_message_bytes: int = 8 << 30
    max_tensors: int = 100_000
    backoff_max_s: float = 0.005
    shared_memory: bool = True  # same-node ranks pass encrypted chunks through a /dev/shm ring


@dataclass(kw_only=True)
class ComponentConfig:
    """A pluggable component: `name` picks it from a registry, the rest are its own options."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Config:
    """A whole federation run."""

    name: str = "run"
    seed: int = 0
    rounds: int = 10
    method: str | None = None  # task-defined shortcut, e.g. method=feddwa|fedavg|local
    eval_every: int = 1
    checkpoint_every: int = 1
    keep_checkpoints: int = 3
    threads_per_rank: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    data_root: str | None = None
    attack: str | None = None  # task-defined malicious-site behaviour (the last client turns malicious)
    halt_after_round: int | None = None  # stop cleanly after this round's checkpoint (time-boxed jobs, resume tests)
    federation: FederationConfig = field(default_factory=FederationConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    strategy: ComponentConfig = field(default_factory=lambda: ComponentConfig(name="fedavg"))
    task: ComponentConfig = field(default_factory=lambda: ComponentConfig(name="synthetic"))
    source: str = ""  # file the config came from (for error messages)

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def hash(self) -> str:
        """Stable short hash of everything that determines the run (not where it came from)."""
        data = self.to_dict()
        data.pop("source", None)
        blob = json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# loading


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, apply ``key=value`` overrides, validate, and return a `Config`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; configs live in configs/*.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return from_mapping(raw, overrides, source=str(path))


def from_mapping(raw: Mapping[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str = "<dict>") -> Config:
    data = _normalise_components(json.loads(json.dumps(raw, default=str)))
    for item in overrides:
        _apply_override(data, item, source)
    data = _normalise_components(data)
    data["source"] = source
    return build(Config, data, where=source)


def _normalise_components(data: dict[str, Any]) -> dict[str, Any]:
    """Accept ``task: {name: x, lr: 1}`` and ``task: x`` and turn both into name + options."""
    for key in ("task", "strategy"):
        value = data.get(key)
        if isinstance(value, str):
            data[key] = {"name": value, "options": {}}
        elif isinstance(value, dict) and "options" not in value:
            value = dict(value)
            name = value.pop("name", None)
            data[key] = {"name": name, "options": value}
        elif isinstance(value, dict):
            extra = {k: v for k, v in value.items() if k not in ("name", "options")}
            value["options"].update(extra)
            data[key] = {"name": value.get("name"), "options": value["options"]}
    return data


def _apply_override(data: dict[str, Any], item: str, source: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. rounds=5, task.lr=0.01)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    value = yaml.safe_load(text) if text.strip() else ""
    parts = key.split(".")
    if parts[0] in ("task", "strategy") and len(parts) >= 2 and parts[1] not in ("name", "options"):
        parts = [parts[0], "options", *parts[1:]]
    if parts[0] in ("task", "strategy") and len(parts) == 1:
        parts = [parts[0], "name"]
    node = data
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def build(cls: type[T], data: Any, where: str = "", prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, checking keys, types and allowed values."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_loc(where, prefix.rstrip('.') or cls.__name__)} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise ConfigError(
            f"{_loc(where, key)}: unknown key; allowed keys here: {', '.join(sorted(fields))}"
        )
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
        except ValueError as exc:
            raise ConfigError(f"{_loc(where, prefix.rstrip('.') or cls.__name__)}: {exc}") from None
    return obj


def _loc(where: str, key: str) -> str:
    return f"{where}: {key}" if where else key


def _coerce(value: Any, hint: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{_loc(where, key)} = {value!r} is not allowed; choose one of: {', '.join(map(str, args))}")
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
    if dataclasses.is_dataclass(hint):
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
