"""What a site lets the server learn when secure aggregation tests groups (docs/threats.md,
"Finding a site that breaks the encoding"): the rules a site applies to a requested partition of
the round into groups, and the history of sums it has let be revealed.

A revealed sum is a set of sites (the sum of their inputs). The server may add and subtract every
sum it has seen, so what it learns is the linear span of the revealed sets' indicator vectors. We
treat all rounds' inputs as if they were the same (the worst case: an update that barely changes
from round to round), so a combination with few sites in its support is a leak even when its sums
come from different rounds. Two rules, both checked by every site on what it is shown:

- ``min_group``: every group of the round has at least `min_group` sites.
- ``small combination``: no combination of the sums revealed so far and the round's groups (each
  group, and so their union, the round's whole sum) equals a combination of fewer than `min_group`
  sites' inputs that the sums revealed so far did not already give. This covers two sums whose
  difference is one site (G and G minus one site), two sums that differ by one site on each side
  (a difference of two inputs), and unions (a full sum minus the groups of a round that left one
  site out). Checked exactly: a vector of the span is zero outside a set T iff the rank of the
  revealed sets drops when T's columns are removed.

Plus the shape of a request (``partition``): groups of known, distinct sites, disjoint, this site
in exactly one; and, when the survivors are announced, ``whole groups``: a group round sums whole
groups only (no dropout inside a group: a group less one site would be a second, smaller sum).

Not new leaks only: plain secure aggregation already lets the sums of two full rounds differ by a
site that dropped (sums of different rounds' inputs); the rules keep group testing from adding to
that, they do not forbid what the history already gave.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from hpcfed.privacy.secagg import ProtocolError

Group = frozenset[int]
_NULL_TOL = 1e-8  # a null-space row block's singular value below this is zero (0/1 matrices, K <= a few hundred)


class GroupRefused(ProtocolError):
    """A site refused a group request; `rule` names the rule it would break."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"group request refused (rule {rule!r}): {detail}")
        self.rule = rule


def parse_partition(groups: object, num_sites: int, site: int | None = None) -> list[Group]:
    """The round's groups as the server sent them (hostile): a list of lists of distinct site ids in
    0..num_sites-1, pairwise disjoint, `site` (when given) in exactly one. Raises GroupRefused."""
    if not isinstance(groups, list) or not 1 <= len(groups) <= num_sites:
        raise GroupRefused("partition", f"groups must be a list of 1..{num_sites} lists, got {str(groups)[:60]}")
    out: list[Group] = []
    seen: set[int] = set()
    for g in groups:
        if not isinstance(g, list) or len(g) > num_sites or not all(type(v) is int and 0 <= v < num_sites for v in g):
            raise GroupRefused("partition", f"a group must list site ids in 0..{num_sites - 1}, got {str(g)[:60]}")
        members = frozenset(g)
        if len(members) != len(g) or members & seen:
            twice = sorted(members & seen) or sorted(v for v in g if g.count(v) > 1)
            raise GroupRefused("partition", f"groups overlap: site {twice[0]} is named twice")
        seen |= members
        out.append(members)
    if site is not None and site not in seen:
        raise GroupRefused("partition", f"site {site} is in none of the groups")
    return out


def check_sizes(groups: Sequence[Group], min_group: int) -> None:
    """Rule ``min_group``: no group smaller than `min_group` sites."""
    for g in groups:
        if len(g) < min_group:
            raise GroupRefused("min_group", f"group {sorted(g)} has {len(g)} site(s), fewer than "
                                            f"privacy.secagg.min_group={min_group}")


def _matrix(sets: Sequence[Group], num_sites: int) -> np.ndarray:
    m = np.zeros((len(sets), num_sites))
    for i, s in enumerate(sets):
        m[i, sorted(s)] = 1.0
    return m


def small_combinations(sets: Sequence[Group], num_sites: int, min_group: int) -> set[Group]:
    """Every set T of fewer than `min_group` sites such that some combination of `sets` is nonzero
    on T only (so the server holds a combination of those few inputs): rank(M) > rank(M without T).

    Computed from one SVD: with N an orthonormal basis of M's null space, the combinations of M's
    rows supported on T are the vectors on T orthogonal to N, so rank(M) - rank(M without T) =
    |T| - rank(N's rows T); T leaks iff N's rows T are linearly dependent (a zero row when |T| = 1).
    `tests/privacy/test_group_testing.py` checks it against the rank definition."""
    if not sets:
        return set()
    m = _matrix(sets, num_sites)
    _, sv, vt = np.linalg.svd(m)
    tol = sv.max(initial=0.0) * max(m.shape) * np.finfo(float).eps  # numpy's matrix_rank tolerance
    null = vt[int((sv > tol).sum()):].T  # num_sites x nullity, orthonormal columns
    used = sorted(set().union(*sets))  # a column outside every set cannot carry a combination
    norms = np.linalg.norm(null[used], axis=1)  # |T| = 1 for every site at once: a zero row
    found: set[Group] = {frozenset([s]) for s, n in zip(used, norms, strict=True) if n < _NULL_TOL}
    for size in range(2, min_group):
        for t in itertools.combinations(used, size):
            if any(f <= set(t) for f in found):
                continue  # a smaller T inside it already leaks; T adds nothing to report
            rows = null[list(t)]
            if rows.shape[1] < size or np.linalg.svd(rows, compute_uv=False).min() < _NULL_TOL:
                found.add(frozenset(t))
    return found


def check_span(history: Sequence[Group], new: Sequence[Group], num_sites: int, min_group: int,
               before: set[Group] | None = None) -> None:
    """Rule ``small combination``: revealing `new` besides `history` gives no combination of fewer
    than `min_group` sites that `history` alone did not give (`before`: `small_combinations` of
    `history`, when the caller has it)."""
    if before is None:
        before = small_combinations(history, num_sites, min_group)
    after = small_combinations([*history, *new], num_sites, min_group)
    fresh = sorted(after - before, key=sorted)
    if fresh:
        t = sorted(fresh[0])
        names = f"site {t[0]}'s input" if len(t) == 1 else f"a combination of sites {t}'s inputs only"
        raise GroupRefused("small combination", f"with the sums revealed before, these groups would give the server "
                                                f"{names}, fewer than privacy.secagg.min_group={min_group} sites")


class SiteRules:
    """One site's memory of the sums it let be revealed, and its check of each group request."""

    def __init__(self, site: int, num_sites: int, min_group: int) -> None:
        self.site, self.num_sites, self.min_group = site, num_sites, min_group
        self.history: list[Group] = []  # every set whose sum the site answered an unmask request for
        self.groups: dict[int, list[Group]] = {}  # round -> the groups it accepted for that round

    def accept(self, rnd: int, groups: object) -> Group:
        """Check round `rnd`'s requested groups (hostile, as sent); this site's group. Raises GroupRefused."""
        parsed = parse_partition(groups, self.num_sites, self.site)
        check_sizes(parsed, self.min_group)
        check_span(self.history, parsed, self.num_sites, self.min_group)
        self.groups = {rnd: parsed}  # only the round in progress: an earlier one's request is over
        return next(g for g in parsed if self.site in g)

    def check_survivors(self, rnd: int, survivors: Iterable[int]) -> None:
        """Rule ``whole groups``: in a group round the sums are of whole groups, so the survivor set
        must be every site of the round's groups (a group less one site would be a smaller sum)."""
        groups = self.groups.get(rnd)
        if groups is None:
            return
        union = frozenset().union(*groups)
        missing = sorted(union - set(survivors))
        if missing or set(survivors) != union:
            odd = missing[0] if missing else sorted(set(survivors) - union)[0]
            raise GroupRefused("whole groups", f"round {rnd} sums whole groups only, but the survivor set "
                                               f"{'leaves out' if missing else 'adds'} site {odd}")

    def revealed(self, rnd: int, survivors: Iterable[int]) -> None:
        """The site answered round `rnd`'s unmask request: the sums the server may now hold."""
        groups = self.groups.pop(rnd, None)
        for g in groups if groups is not None else [frozenset(survivors)]:
            if g not in self.history:  # a set seen again adds nothing to the span
                self.history.append(g)
