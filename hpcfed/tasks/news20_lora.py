"""20 Newsgroups topic classification by federated LoRA fine-tuning (``task: lora_20ng``).

The posts come from ``text/20news-bydate.tar.gz`` under the data root (`hpcfed.data.corpus`). The
label skew is Dirichlet(`label_skew`): one draw per class says how that class splits over the
`sites` sites (`hpcfed.data.partition.label_skew_shares`); the same shares cut the train and the
test split, so a site's test posts have its own label mix. Every site then keeps a seeded sample of
its share (`train_docs`, `val_docs`, `test_docs`), so a run's size is set by the config, not by the
corpus. Besides its own test posts, every site scores the same balanced sample of the test split
(`global_test_docs`: ``global_accuracy``).

``centralized: true`` is the baseline that pools the data: its one site trains on the union of the
`sites` sites' training samples and reports, per original site k, ``site{k}_accuracy`` on that
site's test posts. Local-only training is ``strategy: local`` with the federated config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcfed.tasks.base import Site
from hpcfed.tasks.lora_text import LoraTextTask


class News20LoraTask(LoraTextTask):
    """20 Newsgroups topic classification by federated LoRA, with Dirichlet label skew over the sites."""

    name = "lora_20ng"

    @dataclass(kw_only=True)
    class Config(LoraTextTask.Config):
        label_skew: float = 0.5  # Dirichlet concentration; smaller = more skewed
        sites: int = 0  # sites the corpus is split over; 0 = the number of clients
        train_docs: int = 300  # per site
        val_docs: int = 50
        test_docs: int = 150
        global_test_docs: int = 300
        remove: list[str] = field(default_factory=lambda: ["headers", "footers", "quotes"])
        keep_subject: bool = True
        centralized: bool = False

        def validate(self) -> None:
            super().validate()
            if self.label_skew <= 0:
                raise ValueError(f"label_skew must be > 0, got {self.label_skew}")
            for key in ("train_docs", "val_docs", "test_docs"):
                if getattr(self, key) < 1:
                    raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
            if self.sites < 0 or self.global_test_docs < 0:
                raise ValueError("sites and global_test_docs must be >= 0")
            from hpcfed.data.corpus import check_remove

            check_remove(self.remove, "remove")

    def __init__(self, config: Config, site: Site) -> None:
        self._splits = self._load_splits(config, site)
        super().__init__(config, site)

    def num_labels(self) -> int:
        from hpcfed.data.corpus import NEWSGROUPS

        return len(NEWSGROUPS)

    def texts(self, split: str) -> tuple[list[str], list[int]]:
        return self._splits.get(split, ([], []))

    def evaluate(self, round: int, final: bool = False) -> dict[str, float]:
        result = super().evaluate(round, final)
        if final:
            for split in sorted(self._splits):
                if split.startswith("site") or split == "global":
                    scores = self.evaluate_on(self.eval_data(split))
                    result.update({f"{split}_{k}": v for k, v in scores.items() if k in ("accuracy", "macro_f1")})
        return result

    @staticmethod
    def _load_splits(c: Config, site: Site) -> dict[str, tuple[list[str], list[int]]]:
        from hpcfed.data.corpus import NEWSGROUPS, load_20newsgroups
        from hpcfed.data.partition import label_skew_shares, split_by_shares

        sites = c.sites or site.num_clients
        if not c.centralized and sites != site.num_clients:
            raise ValueError(f"task.sites={sites} but the federation has {site.num_clients} clients; "
                             f"set sites: 0 (or centralized: true for the pooled baseline)")
        remove, keep_subject = tuple(c.remove), c.keep_subject
        train = [d for d in load_20newsgroups(site.data_root, subset="train", remove=remove, keep_subject=keep_subject)
                 if d.text.strip()]
        test = [d for d in load_20newsgroups(site.data_root, subset="test", remove=remove, keep_subject=keep_subject)
                if d.text.strip()]
        shares = label_skew_shares(len(NEWSGROUPS), sites, c.label_skew, site.seed)
        train_owner = split_by_shares(np.array([d.label for d in train]), shares, site.seed)
        test_owner = split_by_shares(np.array([d.label for d in test]), shares, site.seed + 1)

        def sample(docs: list, owners: np.ndarray, k: int, n: int, offset: int, key: int) -> list:
            held = np.flatnonzero(owners == k)
            order = np.random.default_rng([site.seed, k, key]).permutation(held)
            return [docs[i] for i in order[offset : offset + n]]

        def pair(docs: list) -> tuple[list[str], list[int]]:
            return [d.text for d in docs], [int(d.label) for d in docs]

        mine = range(sites) if c.centralized else [site.client_id]
        splits: dict[str, Any] = {
            "train": pair([d for k in mine for d in sample(train, train_owner, k, c.train_docs, 0, 1)]),
            "val": pair([d for k in mine for d in sample(train, train_owner, k, c.val_docs, c.train_docs, 1)]),
            "test": pair([d for k in mine for d in sample(test, test_owner, k, c.test_docs, 0, 2)]),
        }
        if c.centralized:
            for k in range(sites):
                splits[f"site{k}"] = pair(sample(test, test_owner, k, c.test_docs, 0, 2))
        if c.global_test_docs:
            pick = np.sort(np.random.default_rng([site.seed, 9001]).permutation(len(test))[: c.global_test_docs])
            splits["global"] = pair([test[i] for i in pick])
        return splits
