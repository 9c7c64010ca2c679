"""What a DAMe site holds (spec 1.1): its messages, their features and graph, and its splits.

Kept apart from `hpcfed.tasks.events` (how a site learns) so the task reads as training and
evaluation only. Every draw is seeded by (data_seed, stream, the site's dataset name), so a site
holds the same messages and test split in every config, run seed and client position.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcfed.tasks.base import Site
from hpcfed.tasks.event_training import seeded_rng, site_key

log = logging.getLogger("hpcfed.tasks.events")


@dataclass
class EventSite:
    """One site's data: messages sorted by time, event labels, features, CSR graph and splits."""

    dataset: str  # the selector from task.sites (or attack_site)
    messages: Any  # hpcfed.data.messages.Messages
    labels: np.ndarray  # event index per message
    event_names: list[str]
    x: Any  # torch.Tensor (n, text_dim + 2)
    rowptr: np.ndarray
    col: np.ndarray
    train_idx: np.ndarray
    val_idx: np.ndarray
    test_idx: np.ndarray
    train_labels: np.ndarray  # the labels trained on (randomly replaced at a data attacker)


def load_event_site(config: Any, site: Site, input_dim: int) -> EventSite:
    """Load, subsample, featurise and split the messages of `site` (an `EventsTask.Config`)."""
    import torch

    from hpcfed.data.message_graph import edge_index, message_adjacency, message_attributes
    from hpcfed.models.gat import to_csr

    c = config
    cid = site.client_id
    name = _dataset(c, site)
    msgs = _messages(name, c.data_seed, site)
    key = site_key(name, cid if site.attack else None)
    if c.max_messages_per_site is not None and len(msgs) > c.max_messages_per_site:
        pick = np.sort(seeded_rng(c.data_seed, 11, key).choice(len(msgs), c.max_messages_per_site, replace=False))
        msgs = msgs.take(pick.tolist())
    msgs = msgs.sort_by_time()  # spec 1.1 step 1
    events, labels = np.unique(np.asarray(msgs.events), return_inverse=True)
    x = torch.from_numpy(_features(msgs, c, cid, input_dim))
    log.info("site %d: building the message graph of %d messages", cid, len(msgs))
    rowptr, col = to_csr(edge_index(message_adjacency(message_attributes(msgs))), len(msgs))
    n = len(msgs)
    perm = seeded_rng(c.data_seed, 13, key).permutation(n)
    n_val, n_test = int(c.val_fraction * n), int(c.test_fraction * n)
    train_labels = labels.copy()
    if site.attack == "data":
        flip = seeded_rng(site.seed, 17, cid).random(n) < c.flip_fraction
        train_labels[flip] = seeded_rng(site.seed, 19, cid).integers(0, len(events), int(flip.sum()))
    log.info("site %d: %s, %d messages, %d events, %d edges", cid, name, n, len(events), len(col))
    return EventSite(dataset=name, messages=msgs, labels=labels, event_names=[str(e) for e in events], x=x,
                     rowptr=rowptr, col=col, train_idx=np.sort(perm[n_val + n_test:]),
                     val_idx=np.sort(perm[:n_val]), test_idx=np.sort(perm[n_val:n_val + n_test]),
                     train_labels=train_labels)


def _dataset(config: Any, site: Site) -> str:
    """The dataset selector of `site`: its entry of task.sites, or attack_site for an extra attacker."""
    sites = config.sites
    if site.client_id < len(sites):
        return str(sites[site.client_id])
    if site.attack:
        return str(config.attack_site)
    raise ValueError(f"client {site.client_id} has no dataset: task.sites lists {len(sites)} sites "
                     f"({', '.join(sites)}); run with --np {len(sites) + 1} or add sites")


def _messages(name: str, data_seed: int, site: Site) -> Any:
    from hpcfed.data.message_datasets import load_site

    if name.startswith("synthetic"):
        from hpcfed.data.synthetic_messages import make_messages

        # "synthetic" or "synthetic:SHIFT": planted events, keyword blocks shifted by SHIFT
        shift = int(name.split(":", 1)[1]) if ":" in name else 0
        return make_messages(data_seed, site.client_id, shift=shift)
    msgs, report = load_site(name, site.data_root)
    log.info("%s", report.summary())
    return msgs


def _features(msgs: Any, config: Any, cid: int, input_dim: int) -> np.ndarray:
    from hpcfed.data.text_features import message_features

    log.info("site %d: %d message features (%s), from the cache or encoded now", cid, len(msgs), config.text_model)
    x = message_features(msgs.texts, msgs.times, config.text_model, cache=config.feature_cache, device="cpu",
                         progress=f"site {cid}")
    if x.shape[1] != input_dim:
        raise ValueError(f"text model {config.text_model!r} gives {x.shape[1] - 2} dims but task.text_dim="
                         f"{config.text_dim}; set task.text_dim={x.shape[1] - 2}")
    return x


def export_fields(dataset: str, event_names: list[str], messages: Any, shared_space: bool) -> dict[str, Any]:
    """What a site's export carries beside its vectors: the event names (``label_names``, so that
    cross-site figures compare names, not each site's own numbers), whether the sites share one
    vector space, and per message its time and text (what `hpcfed search` filters on and shows)."""
    return {"extra": {"dataset": dataset, "events": ",".join(event_names), "label_names": json.dumps(event_names),
                      "shared_space": shared_space},
            "columns": {"time": messages.times.astype("datetime64[s]").astype(np.int64), "text": list(messages.texts)}}
