"""Typed run configuration: YAML + ``key=value`` overrides -> validated dataclasses.

Every section is a keyword-only dataclass. `build` checks unknown keys, types and allowed values and
raises `ConfigError` naming the dotted key (``federation.quorum``), the file, and what is allowed.
Task and strategy sections are free-form here; each task/strategy validates its own keys with
`build` on its own ``Config`` dataclass, so their errors read the same way (``task.lr``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# The privacy sections have a module of their own; they are part of the run configuration.
from hpcfed.config_privacy import AdaptiveClipConfig as AdaptiveClipConfig
from hpcfed.config_privacy import DPConfig as DPConfig
from hpcfed.config_privacy import PrivacyConfig as PrivacyConfig
from hpcfed.config_privacy import RecordDPConfig as RecordDPConfig
from hpcfed.config_privacy import SecAggConfig as SecAggConfig

# ConfigError and load_yaml are re-exported: callers take them with the config
from hpcfed.errors import ConfigError as ConfigError
from hpcfed.safe_yaml import MAX_YAML_BYTES
from hpcfed.safe_yaml import load_yaml as load_yaml

# The typed builder (`hpcfed.schema`) is below the run configuration: config uses it, never the reverse.
from hpcfed.schema import InvalidValue, Origin, build, to_plain
from hpcfed.schema import at_least as _at_least
from hpcfed.schema import positive as _positive

MAX_CRYPTO_THREADS = 64


@dataclass(kw_only=True)
class FederationConfig:
    """How the server drives clients."""

    # Not a setting: the strategy's base decides it (`Config.mode`). `hpcfed.registry.resolve` fills
    # it in; a config that still gives it must agree with the strategy, or is refused with the fix.
    mode: Literal["sync", "async"] | None = None
    num_clients: int | None = None  # default: MPI world size - 1; must match it when given
    quorum: float = 1.0  # fraction of clients whose update closes a sync round
    round_deadline_s: float = 600.0  # a sync round closes at the deadline if the quorum is met
    client_timeout_s: float = 900.0  # a client gives up on a silent server after this
    setup_timeout_s: float = 300.0
    max_updates: int | None = None  # async: total accepted uploads before stopping (default rounds*K)
    # async: uploads per buffer (FedBuff; a secure buffer's members); 2..K, default half the sites
    buffer_size: int | None = None
    slowdown: dict[int, float] = field(default_factory=dict)  # client_id -> factor (straggler knob)
    on_client_failure: Literal["abort", "continue"] = "abort"
    # Evictions (security.on_misbehaviour) never take the federation below this many sites: it
    # stops cleanly instead, keeping its last checkpoint.
    min_sites: int = 1
    # Client ids left out of this run (a hostile site that ends the job itself, e.g. by MPI_Abort):
    # `--resume federation.exclude_sites=[2]` goes on from the last checkpoint without them.
    exclude_sites: list[int] = field(default_factory=list)
    status_every_s: float = 30.0
    # where each site keeps its own checkpoint shards (optimizer, RNG, personal models); the server
    # never sees them. Placeholders: {out} (run dir), {client}, {rank}, {job} ($SLURM_JOB_ID or 'local').
    site_state_dir: str = "{out}/sites/{client}"
    # MPI ranks per site (one R for every site, or one per site): the site's ranks train together,
    # data-parallel, and only its first rank, the leader, talks to the server (hpcfed.site_layout).
    ranks_per_site: int | list[int] = 1

    def validate(self) -> None:
        from hpcfed.site_layout import ranks_problem

        if (problem := ranks_problem(self.ranks_per_site)) is not None:
            raise InvalidValue("ranks_per_site", problem.lstrip("="))
        if isinstance(self.ranks_per_site, list) and self.num_clients is not None \
                and len(self.ranks_per_site) != self.num_clients:
            raise InvalidValue("ranks_per_site", f"lists {len(self.ranks_per_site)} sites but num_clients is "
                                                 f"{self.num_clients}; give one R per site")
        if not 0.0 < self.quorum <= 1.0:
            raise InvalidValue("quorum", f"must be a fraction in (0, 1], got {self.quorum!r}")
        _positive(self, "round_deadline_s", "client_timeout_s", "setup_timeout_s", "status_every_s")
        _at_least(self, 1, "num_clients", "max_updates", "min_sites")
        if self.buffer_size is not None:
            self.check_buffer(self.num_clients)
        for cid in self.exclude_sites:
            if cid < 0 or (self.num_clients is not None and cid >= self.num_clients):
                raise InvalidValue("exclude_sites", f"names client {cid!r}, which is not a site of this run")
        for cid, factor in self.slowdown.items():
            if not factor > 0:
                raise InvalidValue(f"slowdown.{cid}", f"must be > 0, got {factor!r}")

    def check_buffer(self, num_sites: int | None) -> None:
        """`buffer_size` within 2..K (`num_sites`, when known): a buffer of one is a site's own update."""
        size = self.buffer_size
        if size is None:
            return
        if size < 2:
            raise InvalidValue("buffer_size", f"must be at least 2 (a buffer of one is one site's update in the "
                                              f"clear), got {size!r}")
        if num_sites is not None and size > num_sites:
            raise InvalidValue("buffer_size", f"is {size}, more than the {num_sites} sites of this run: no buffer "
                                              f"could fill; give 2..{num_sites}")


TRACKING_KINDS = ("tensorboard", "mlflow")


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
    # What an authenticated site's misbehaviour (a malformed, out-of-range or unrequested message)
    # costs it: evict it and go on without it, abort the job naming it, or only count it.
    on_misbehaviour: Literal["evict", "abort", "ignore"] = "evict"
    # Bounded influence refusing a site's upload is evidence only past this many refusals (an
    # honest outlier may be refused now and then).
    max_refused_updates: int = 3

    def validate(self) -> None:
        _at_least(self, 1, "max_rejects")
        _at_least(self, 0, "max_refused_updates")


@dataclass(kw_only=True)
class CommConfig:
    """The ``comm`` section: chunk size, message and tensor-count bounds, polling back-off, the
    same-node shared-memory ring and the sealing threads of each rank's channel."""

    chunk_bytes: int = 4 << 20
    max_message_bytes: int = 8 << 30
    max_tensors: int = 100_000
    backoff_max_s: float = 0.005
    shared_memory: bool = True  # same-node ranks pass encrypted chunks through a /dev/shm ring
    # Threads that seal a big message's chunks in parallel (AES-GCM releases the GIL); None: the
    # cores this rank may run on, at most 8.
    crypto_threads: int | None = None

    def validate(self) -> None:
        _at_least(self, 1, "chunk_bytes", "max_message_bytes", "max_tensors")
        if self.crypto_threads is not None and not (
                isinstance(self.crypto_threads, int) and 1 <= self.crypto_threads <= MAX_CRYPTO_THREADS):
            raise InvalidValue("crypto_threads", f"must be an integer in 1..{MAX_CRYPTO_THREADS} (or left out "
                                                 f"for the cores available, at most 8), got {self.crypto_threads!r}")
        _at_least(self, 0, "backoff_max_s")


@dataclass(kw_only=True)
class InfluenceConfig:
    """What one site can do to the model (`hpcfed.server.influence`); on by default."""

    enabled: bool = True
    max_weight_factor: float = 1.0  # weight cap, relative to the median claimed size
    clip_factor: float = 1.0  # distance cap, x the median recent distance (or the site's own recent steps, up to 2x it)
    # Refuse uploads farther than this x the median recent distance (and the site's own recent steps):
    # never counted against the site; farther than this x the model's own scale, counted (evidence).
    reject_factor: float = 10.0
    # Bound the first uploads by their own median distance: they are parked on rank 0's disk (K x
    # model bytes, in out/scratch) until the first sync round, or min(3, K) async sites, are in.
    # False: clip them to the model's norm.
    calibrate_first_round: bool = True

    def validate(self) -> None:
        for name in ("max_weight_factor", "clip_factor"):
            if not getattr(self, name) >= 1.0:
                raise InvalidValue(name, f"must be >= 1, got {getattr(self, name)!r}")
        if not self.reject_factor > self.clip_factor:
            raise InvalidValue("reject_factor",
                               f"must be > clip_factor ({self.clip_factor}), got {self.reject_factor!r}")


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
    tracking: str | None = None  # live view by rank 0: tensorboard, mlflow or both (server/tracking.py)
    federation: FederationConfig = field(default_factory=FederationConfig)
    influence: InfluenceConfig = field(default_factory=InfluenceConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    strategy: ComponentConfig = field(default_factory=lambda: ComponentConfig(name="fedavg"))
    task: ComponentConfig = field(default_factory=lambda: ComponentConfig(name="synthetic"))
    source: str = ""  # file the config came from (for error messages; an `Origin` after `load`)

    def validate(self) -> None:
        _at_least(self, 1, "rounds", "keep_checkpoints", "threads_per_rank")
        _at_least(self, 0, "eval_every", "checkpoint_every", "halt_after_round")
        bad = [k for k in (self.tracking or "").split(",") if k.strip() and k.strip() not in TRACKING_KINDS]
        if bad:
            raise InvalidValue("tracking", f"{bad[0].strip()!r} is not a tracker; use {', '.join(TRACKING_KINDS)} "
                                           f"(comma-separated), or leave it out")

    @property
    def mode(self) -> Literal["sync", "async"]:
        """"sync" or "async": what the strategy is (`SyncStrategy`/`AsyncStrategy`), once resolved."""
        if self.federation.mode is None:
            raise ConfigError("the run's mode is not known until its strategy is looked up: "
                              "pass the config through hpcfed.registry.resolve first")
        return self.federation.mode

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
    if path.stat().st_size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes is too large for a config (limit {MAX_YAML_BYTES})")
    raw = load_yaml(path.read_text(), str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return from_mapping(raw, overrides, source=str(path))


def from_mapping(raw: Mapping[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str = "<dict>") -> Config:
    """Build and validate a `Config` from an already parsed mapping (`load` passes the YAML document;
    tests and tools pass a dict) plus ``key=value`` overrides; `source` names it in error messages."""
    data = _normalise_components(json.loads(json.dumps(raw, default=str)))
    set_by: dict[str, str] = {}
    for item in overrides:
        set_by[_apply_override(data, item)] = item
    data = _normalise_components(data)
    origin = Origin(source, set_by)
    data["source"] = source
    cfg = build(Config, data, where=origin)
    cfg.source = origin
    return cfg


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


def _apply_override(data: dict[str, Any], item: str) -> str:
    """Set one ``key=value`` in `data`; returns the dotted key as errors name it (``task.lr``)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. rounds=5, task.lr=0.01)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: {key!r} is not a dotted key like rounds or task.lr")
    # Values are plain YAML scalars or flow collections, parsed safely (no tags, no alias bombs).
    value = load_yaml(text, f"command line ({item})") if text.strip() else ""
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
            raise ConfigError(f"command line ({item}): {part!r} is not a section")
        node = nxt
    node[parts[-1]] = value
    component = parts[0] in ("task", "strategy")
    return ".".join(p for i, p in enumerate(parts) if not (component and i == 1 and p == "options"))


# ----------------------------------------------------------------------------------------------
# resuming

# What a checkpoint's state depends on: resuming it under a config that changes any of these would
# load state of another shape or meaning (e.g. FedAvg's checkpoint into FedDWA). Everything else --
# rounds, timeouts, checkpointing, security, comm, device -- may change between attempts.
# (The mode follows from the strategy, so "strategy" covers it.)
# The privacy mechanism too (ε is a function of the rounds done and these); max_epsilon is a budget
# like rounds and may change.
RESUME_MUST_MATCH = ("seed", "method", "strategy", "task", "privacy.secure_aggregation", "privacy.dp.clip_norm",
                     "privacy.dp.noise_multiplier", "privacy.dp.delta", "privacy.dp.adaptive", "privacy.dp.noise",
                     "privacy.secagg.clip_norm", "privacy.secagg.max_examples", "privacy.record_dp")


def check_resume_compatible(saved: Mapping[str, Any], current: Config, where: str = "the checkpoint") -> None:
    """Raise a one-line `ConfigError` naming every key in `RESUME_MUST_MATCH` whose value in the
    checkpoint's config (`saved`, as stored by `Config.to_dict`) differs from `current`'s."""
    now = current.to_dict()
    differs = []
    for key in RESUME_MUST_MATCH:
        for path, old, new in _diff(_get(saved, key), _get(now, key), key):
            differs.append(f"{_describe(path)}: {old!r} in the checkpoint, {new!r} now")
    if differs:
        shown = "; ".join(differs[:4]) + (f"; and {len(differs) - 4} more" if len(differs) > 4 else "")
        raise ConfigError(f"--resume: {where} was written by a different run configuration ({shown}); "
                          f"resume with the config it was made with, or start a fresh run "
                          f"(another --out, or --force to overwrite)")


def _get(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, Mapping) else None
    return data


def _diff(old: Any, new: Any, path: str) -> list[tuple[str, Any, Any]]:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(k), new.get(k), f"{path}.{k}")
        return out
    old, new = json.loads(json.dumps(old, default=str)), json.loads(json.dumps(new, default=str))
    return [] if old == new else [(path, old, new)]


def _describe(path: str) -> str:
    return path.replace("strategy.options.", "strategy.").replace("task.options.", "task.")
