"""Group testing in the secure round, rank 0's side (docs/threats.md, "Finding a site that breaks
the encoding"): which groups a round sums, judging each unmasked sum, folding the clean ones, and
evicting a site the refused ones prove hostile. The schedule and the inference rule are pure
(`hpcfed.privacy.group_testing`); the secure collector (`hpcfed.server.secagg_round`) calls this at
three points: the round's groups (PARAMS, the graph), whether every site of them masked, and the
unmasked result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from hpcfed.errors import FederationError
from hpcfed.privacy import audit
from hpcfed.privacy.group_rules import Group
from hpcfed.privacy.group_testing import Isolation, Verdict, group_noise_multiplier
from hpcfed.privacy.secagg import group_graph, members_graph
from hpcfed.privacy.secagg_server import ServerState
from hpcfed.privacy.site_input import InputSpec, judge_sum, sites_needed
from hpcfed.server.core import ServerCore
from hpcfed.server.eviction import Eviction
from hpcfed.strategies.dp import DistributedDP

log = logging.getLogger("hpcfed.server")

Fold = Callable[[np.ndarray, int, int], None]  # (Σ n_k·δ_k, Σ n_k, sites) into the strategy


class GroupTesting:
    """Rank 0's group testing over the run: the round's groups, and what their sums prove."""

    def __init__(self, core: ServerCore, spec: InputSpec) -> None:
        self.core, self.spec = core, spec
        secagg, k = core.config.privacy.secagg, core.num_clients
        if secagg.min_group > k:
            raise FederationError(f"privacy.secagg.min_group={secagg.min_group} is above the {k} sites of this run: "
                                  f"no sum could be revealed; set it to 2..{k}")
        self.isolation = Isolation(k, secagg.min_group, secagg.max_hostile, core.config.run.seed)
        self.groups: list[Group] | None = None  # the groups of the round in progress; None: the whole federation
        self.first_evidence: dict[int, str] = {}  # site -> the first refused sum it was in
        self.refused_whole: int | None = None  # the last round whose whole-federation sum was refused

    def start(self, rnd: int) -> list[list[int]] | None:
        """Round `rnd`'s groups as PARAMS carries them (None: the whole federation sums)."""
        self.groups = self.isolation.groups_for(rnd, self.core.live)
        if self.groups is None:
            return None
        sizes = ", ".join(str(len(g)) for g in self.groups)
        log.warning("round %d sums %d disjoint groups of sites (sizes %s), each securely, to find the site whose "
                    "input broke the encoding", rnd, len(self.groups), sizes)
        self.core.metrics.log(rnd, None, "secagg_groups", len(self.groups))
        dp = self.core.config.privacy.dp
        if dp is not None:  # docs/threats.md, "The DP noise in a group sum"
            m = sites_needed(self.core.num_clients, self.core.config.roster.quorum)
            fewest = min(map(len, self.groups))
            z_group = group_noise_multiplier(dp.noise_multiplier, fewest, m)
            log.warning("round %d: under distributed DP a group sum of g sites carries only their noise, std "
                        "z*C*sqrt(g/%d): the smallest group (%d sites) is released at noise multiplier %.3g, not "
                        "z=%g, and the accountant counts the round at it", rnd, m, fewest, z_group,
                        dp.noise_multiplier)
            if isinstance(self.core.strategy, DistributedDP):
                self.core.strategy.release_at(z_group)
        return [sorted(g) for g in self.groups]

    def graph(self, rnd: int, degree: int | None) -> dict[int, set[int]]:
        """The round's neighbour graph: within each group in a group round, SecAgg+'s otherwise."""
        if self.groups is None:
            return members_graph(self.core.live, self.core.num_clients, rnd, degree)
        return group_graph(self.groups, rnd, degree)

    def retry_due(self, rnd: int) -> bool:
        """Whether round `rnd`'s whole-federation sum was just refused and group testing is on: then
        the round is retried in groups on the same inputs. Sound under the sites' rules: they treat
        every round's inputs as the same input already (`hpcfed.privacy.group_rules`), so groups of
        the round's own inputs reveal nothing that the next round's groups would not."""
        return self.refused_whole == rnd and self.groups is None and self.isolation.active

    def missing(self, masked: set[int]) -> str | None:
        """In a group round, why its sums cannot be revealed (a site of the groups sent no masked input:
        a group less one site would be a smaller sum, which the sites refuse); None when whole."""
        if self.groups is None:
            return None
        gone = sorted(frozenset().union(*self.groups) - masked)
        return f"a group round sums whole groups only, and site(s) {', '.join(map(str, gone))} sent no masked " \
               f"input" if gone else None

    def answered(self, alive: set[int]) -> None:
        """The sites answered the unmask request: each counts the round's sums (its groups, or the
        alive set) as revealed from now on, so the server's history does too, even if the round is
        then lost: the groups it asks for next must keep the rules against what the sites hold."""
        self.isolation.remember(self.groups or [frozenset(alive)])

    def conclude(self, rnd: int, state: ServerState, alive: set[int], fold: Fold) -> None:
        """Judge the round's unmasked sums (each group's, or the whole round's), fold the clean ones,
        record the refused ones as evidence and evict a site they prove hostile."""
        sets = self.groups or [frozenset(alive)]
        refused: list[Group] = []
        clean: list[tuple[np.ndarray, int, int]] = []
        for g in sets:
            total = state.sum_of(g) if self.groups is not None else state.result()[0]
            if audit.folder() is not None:  # the chaos soak's record (off by default)
                self.core.metrics.log(rnd, None, "audit_sum", audit.sum_probe(total), members=sorted(g))
            try:
                clean.append((*judge_sum(total, len(g), self.spec), len(g)))
            except ValueError as exc:
                refused.append(g)
                self._refused(rnd, g, str(exc))
                self.refused_whole = rnd if self.groups is None else self.refused_whole
        if clean:
            weighted = np.sum([c[0] for c in clean], axis=0)
            if audit.folder() is not None:  # the step FedAvg's fold applies: Σ n_k·δ_k / Σ n_k
                self.core.metrics.log(rnd, None, "audit_step", audit.model_probe(weighted) / sum(c[1] for c in clean))
            fold(weighted, sum(c[1] for c in clean), sum(c[2] for c in clean))
        self.core.metrics.log(rnd, None, "secagg_smallest_sum", min(map(len, sets)))
        for verdict in self.isolation.record(rnd, sets, refused, self.groups is not None):
            self._convict(verdict)

    def buffer_refused(self, buffer: int, members: Group, why: str) -> None:
        """An asynchronous buffer's unmasked sum over `members` was refused (`why`): evidence, as a
        refused round's sum is. Buffers are formed from whoever is ready, so their members differ and
        the evidence narrows without asking for groups (each buffer sums new inputs; none is retried);
        a site it proves hostile is evicted, and only then. Clean sums prove nothing: not recorded."""
        self.isolation.what = "the refused sums of buffers"
        names = ", ".join(map(str, sorted(members)))
        log.warning("buffer %d: the secure sum of sites [%s] is refused, and nothing of it is folded: %s (evidence "
                    "against one of them at least; buffers of other members narrow it down, without unmasking "
                    "anyone)", buffer, names, why)
        self.core.metrics.log(buffer, None, "secagg_sum_refused", 1)
        for site in members:
            self.first_evidence.setdefault(site, f"buffer {buffer}: the secure sum of sites [{names}] was refused: "
                                                 f"{why}"[:200])
        for verdict in self.isolation.record(buffer, [members], [members], False):
            self._convict(verdict)

    def _refused(self, rnd: int, group: Group, why: str) -> None:
        members = ", ".join(map(str, sorted(group)))
        what = "the securely aggregated sum" if self.groups is None else f"the secure sum of group [{members}]"
        log.warning("round %d: %s is refused, %s: %s (group testing narrows down which site, without unmasking "
                    "anyone)", rnd, what,
                    "the round is retried in groups if the rules allow" if self.groups is None
                    else "the other groups' sums are folded", why)
        self.core.metrics.log(rnd, None, "secagg_sum_refused", 1)
        for site in group:
            self.first_evidence.setdefault(site, f"round {rnd}: the secure sum of sites [{members}] was refused: "
                                                 f"{why}"[:200])

    def _convict(self, verdict: Verdict) -> None:
        """Evict the proven site (security.on_misbehaviour: abort ends the run, ignore only logs)."""
        core, site = self.core, verdict.site
        self.isolation.evicted(site)
        if site not in core.live:
            return  # it ended or was evicted since: nothing to carry out
        proof = verdict.proof(self.isolation.max_hostile)
        eviction = Eviction(client=site, rank=site + 1, reason=f"secure sum refused: {proof}",
                            first_evidence=self.first_evidence.get(site, "none"), round=verdict.round)
        if core.ledger.policy == "ignore":
            log.warning("client %d (rank %d) is proven hostile (%s); security.on_misbehaviour=ignore keeps it", site,
                        site + 1, proof)
            return
        if core.ledger.policy == "abort":
            raise FederationError(f"client {site} (rank {site + 1}) misbehaved: {eviction.reason} (security."
                                  f"on_misbehaviour=abort); last checkpoint: {core.last_checkpoint or 'none'}")
        core.evict(eviction)
