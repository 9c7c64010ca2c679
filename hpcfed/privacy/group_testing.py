"""Group testing under secure aggregation: which groups the next round sums, and who a refused sum
proves hostile (docs/threats.md, "Finding a site that breaks the encoding"). Pure: the server's
runtime (`hpcfed.server.secagg_groups`) drives it; the sites' side is `hpcfed.privacy.group_rules`.

Evidence. A sum is refused when it is outside what honest inputs can make (`site_input.decode_sum`,
the norm check): honest inputs are each in the encoding and their sum is too, so a refused sum of a
set R proves that at least one site of R sent a bad input in that round. Nothing else is evidence:
a clean sum proves nothing about anyone (a hostile site may behave in one round and not the next,
or two hostile sites may cancel out), and silence is never evidence.

Inference rule. With at most f hostile sites (`privacy.secagg.max_hostile`, the operator's bound),
the hostile ones form a set of at most f sites meeting every refused set (an explanation). Site s
is proven hostile when every explanation holds s: then, whoever the hostile sites are, s is one of
them. An honest site is never proven while the bound holds (the true hostile set is an explanation
without it); beyond the bound (more colluders than f) they can make an honest site the single
common member of their refused sums, so f must be an upper bound, not a guess.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hpcfed.privacy.group_rules import Group, GroupRefused, check_sizes, check_span, small_combinations

QUIET_ROUNDS = 2  # clean group rounds in a row after which the federation sums whole again
PARTITION_TRIES = 150  # random partitions tried per round; the best that keeps the rules is taken


def explanations(refused: Sequence[Group], max_hostile: int) -> list[Group]:
    """Every set of at most `max_hostile` sites that meets each refused set (drawn from their union)."""
    if not refused:
        return [frozenset()]
    sites = sorted(frozenset().union(*refused))
    out = []
    for size in range(1, max_hostile + 1):
        for combo in itertools.combinations(sites, size):
            if all(r & set(combo) for r in refused):
                out.append(frozenset(combo))
    return out


def proven(refused: Sequence[Group], max_hostile: int) -> set[int]:
    """The sites in every explanation of the refused sets (none when no explanation fits the bound:
    then more than `max_hostile` sites are hostile and nothing can be proven)."""
    found = explanations(refused, max_hostile)
    if not found or not refused:
        return set()
    return set(frozenset.intersection(*found))


def suspects(refused: Sequence[Group], max_hostile: int) -> set[int]:
    """The sites in some explanation: the ones the next groups should split."""
    found = explanations(refused, max_hostile)
    return set().union(*found) if found else set()


def partition(live: Sequence[int], candidates: set[int], history: Sequence[Group], num_sites: int,
              min_group: int, rng: random.Random, tries: int = PARTITION_TRIES) -> list[Group] | None:
    """Disjoint groups of all `live` sites, each of >= `min_group`, that keep the sites' rules with
    `history` (the sums revealed so far), splitting `candidates` as evenly as it can: of `tries`
    random partitions, the one with the fewest candidates in its fullest group, then the fewest
    groups (each group is one more sum revealed). None when no try keeps the rules."""
    live = sorted(live)
    most = len(live) // min_group
    if most < 2:
        return None
    best: tuple[tuple[int, int], list[Group]] | None = None
    before = small_combinations(history, num_sites, min_group)
    for _ in range(tries):
        groups = _deal(live, candidates, rng.randint(2, most), rng)
        try:
            check_sizes(groups, min_group)
            check_span(history, groups, num_sites, min_group, before)
        except GroupRefused:
            continue
        score = (max(len(g & candidates) for g in groups), len(groups))
        if best is None or score < best[0]:
            best = (score, groups)
    return None if best is None else best[1]


def _deal(live: list[int], candidates: set[int], count: int, rng: random.Random) -> list[Group]:
    """`count` groups of near-equal size: the candidates dealt round the groups first, then the rest."""
    cands = [s for s in live if s in candidates]
    others = [s for s in live if s not in candidates]
    rng.shuffle(cands)
    rng.shuffle(others)
    groups: list[list[int]] = [[] for _ in range(count)]
    start = rng.randrange(count)
    for i, s in enumerate(cands):
        groups[(start + i) % count].append(s)
    for s in others:
        min(groups, key=len).append(s)
    return [frozenset(g) for g in groups]


def narrowing(ready: Sequence[int], want: int, suspected: set[int]) -> list[int] | None:
    """An asynchronous buffer's `want` members from the `ready` sites (in the order they became ready)
    with at most one `suspected` site: the first such, so that a refused sum narrows the evidence
    down (a buffer of the same suspects again would only repeat it); None when the ready sites
    do not allow one yet."""
    picked: list[int] = []
    for site in ready:
        if site in suspected and any(p in suspected for p in picked):
            continue
        picked.append(site)
        if len(picked) == want:
            return picked
    return None


def group_noise_multiplier(noise_multiplier: float, group: int, sites_needed: int) -> float:
    """Under distributed DP each site adds noise of std z·C/√m (m = `sites_needed`, the quorum's
    count: a sum over m sites has std z·C). A group sum over `group` sites carries only their
    noise, std z·C·√(g/m): the multiplier it is released at (docs/threats.md, "The DP noise in a
    group sum")."""
    return noise_multiplier * (group / sites_needed) ** 0.5


@dataclass(frozen=True)
class Verdict:
    """A site the refused sums prove hostile, and the proof in words."""

    site: int
    round: int
    rounds: tuple[int, ...]  # the rounds (or asynchronous buffers) whose refused sums hold it
    what: str = "group sums of rounds"  # what the numbers are, in the proof's words

    def proof(self, max_hostile: int) -> str:
        names = ", ".join(map(str, self.rounds[:-1])) + f" and {self.rounds[-1]}" if len(self.rounds) > 1 \
            else str(self.rounds[0])
        return (f"{self.what} {names} isolate site {self.site} (every set of at most {max_hostile} "
                f"site(s) that meets each refused sum holds it)")


@dataclass
class Isolation:
    """The server's group testing across the run: the sums it has seen, the refused ones, whether
    the next round is summed in groups."""

    num_sites: int
    min_group: int
    max_hostile: int
    seed: int = 0
    history: list[Group] = field(default_factory=list)  # every set whose sum was unmasked
    refused: list[tuple[int, Group]] = field(default_factory=list)  # (round, set) of each refused sum
    active: bool = False
    quiet: int = 0  # clean group rounds in a row
    convicted: set[int] = field(default_factory=set)
    what: str = "group sums of rounds"  # the verdicts' words for the sums (asynchronous buffers: their own)

    def groups_for(self, rnd: int, live: Iterable[int]) -> list[Group] | None:
        """Round `rnd`'s groups, or None: sum the whole federation (no pending refusal, or no
        partition keeps the rules: then group testing ends for now, the evidence stays)."""
        if not self.active:
            return None
        live = sorted(live)
        candidates = suspects([r for _, r in self.refused], self.max_hostile) & set(live)
        groups = partition(live, candidates or set(live), self.history, self.num_sites, self.min_group,
                           random.Random(self.seed * 1_000_003 + rnd))
        if groups is None:
            self.active = False
        return groups

    def record(self, rnd: int, revealed: Sequence[Group], refused: Sequence[Group], grouped: bool) -> list[Verdict]:
        """Round `rnd` unmasked the sums of `revealed`, of which `refused` were refused; the sites
        now proven hostile (each once)."""
        self.remember(revealed)
        self.refused.extend((rnd, g) for g in refused)
        if refused:
            self.active, self.quiet = True, 0
        elif grouped:
            self.quiet += 1
            if self.quiet >= QUIET_ROUNDS:
                self.active = False
        verdicts = []
        for site in sorted(proven([r for _, r in self.refused], self.max_hostile) - self.convicted):
            rounds = tuple(sorted({r for r, g in self.refused if site in g}))
            verdicts.append(Verdict(site, rnd, rounds, self.what))
        return verdicts

    def suspected(self) -> set[int]:
        """The sites some explanation of the pending refused sums holds (none pending: none)."""
        return suspects([r for _, r in self.refused], self.max_hostile) if self.refused else set()

    def remember(self, revealed: Iterable[Group]) -> None:
        """Sums the server may hold (each set once: a set seen again adds nothing to the span)."""
        for g in revealed:
            if g not in self.history:
                self.history.append(g)

    def evicted(self, site: int) -> None:
        """`site` is out: the refused sums it is in are explained (dropping evidence can only prove less)."""
        self.convicted.add(site)
        self.refused = [(r, g) for r, g in self.refused if site not in g]
        if not self.refused:
            self.active, self.quiet = False, 0
