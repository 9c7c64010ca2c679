"""Which MPI rank belongs to which site, when a site is a group of ranks (`federation.ranks_per_site`).

``hpcfed run --np 1+K·R`` lays the ranks out site by site: world rank 0 is the server, site k holds
the next R ranks (``1 + k·R .. k·R + R``), and its first one, the site's *leader* (local rank 0),
is the only one that speaks the sealed channel with rank 0. Unequal sites give a list
(``ranks_per_site: [2, 1, 4]``), laid out the same way. Contiguous sites keep a site's ranks on one
node under block placement (mpiexec's and srun's default), which its all-reduce wants.

Pure arithmetic, shared by the launcher, the server (a site ended when any of its ranks did) and the
tests; a layout the ranks cannot make is refused in one line with the arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpcfed.errors import ConfigError


@dataclass(frozen=True)
class SiteLayout:
    """The sizes of the sites, in order; world rank 0 is the server."""

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, ranks_per_site: int | Sequence[int], num_sites: int) -> SiteLayout:
        """The layout of `num_sites` sites under a validated ``ranks_per_site`` (as rank 0 knows it)."""
        if isinstance(ranks_per_site, int):
            return cls((ranks_per_site,) * num_sites)
        return cls(tuple(ranks_per_site)) if len(ranks_per_site) == num_sites else cls((1,) * num_sites)

    @property
    def num_sites(self) -> int:
        """K, the number of sites."""
        return len(self.sizes)

    @property
    def world_size(self) -> int:
        """1 + the ranks of every site."""
        return 1 + sum(self.sizes)

    @property
    def single_rank(self) -> bool:
        """Whether every site is one rank (the layout hpcfed had before sites of many ranks)."""
        return all(size == 1 for size in self.sizes)

    def world_ranks(self, site: int) -> list[int]:
        """The world ranks of site `site`, its leader first."""
        start = 1 + sum(self.sizes[:site])
        return list(range(start, start + self.sizes[site]))

    def leader(self, site: int) -> int:
        """The world rank of site `site`'s leader."""
        return 1 + sum(self.sizes[:site])

    def site_of(self, world_rank: int) -> tuple[int, int] | None:
        """(site, local rank) of a world rank; None for rank 0 (the server)."""
        if world_rank <= 0 or world_rank >= self.world_size:
            return None
        start = 1
        for site, size in enumerate(self.sizes):
            if world_rank < start + size:
                return site, world_rank - start
            start += size
        return None  # unreachable: world_rank < world_size

    def describe(self, world_rank: int) -> str:
        """A world rank in words, for logs and the launcher's last line."""
        where = self.site_of(world_rank)
        if where is None:
            return f"rank {world_rank} (the server)"
        site, local = where
        if self.single_rank:
            return f"rank {world_rank} (client {site})"
        role = "its leader" if local == 0 else f"its rank {local}"
        return f"rank {world_rank} (client {site}, {role})"


def layout_for(ranks_per_site: int | list[int], world_size: int, source: str = "the config") -> SiteLayout:
    """The layout of a job of `world_size` ranks under ``federation.ranks_per_site`` (ConfigError with
    the arithmetic when the ranks do not make whole sites)."""
    clients = world_size - 1
    key = f"{source}: federation.ranks_per_site"
    if isinstance(ranks_per_site, int):
        check_ranks_per_site(ranks_per_site, source)
        if clients < 1 or clients % ranks_per_site:
            k, rest = divmod(clients, ranks_per_site)
            fix = f"--np {1 + max(k, 1) * ranks_per_site}" + (f" or --np {1 + (k + 1) * ranks_per_site}" if k else "")
            raise ConfigError(f"{key}={ranks_per_site} does not divide the {clients} client ranks of a job of "
                              f"{world_size} (1 + {clients} = 1 + {k}·{ranks_per_site} + {rest}); start it with {fix}")
        return SiteLayout((ranks_per_site,) * (clients // ranks_per_site))
    sizes = tuple(ranks_per_site)
    check_ranks_per_site(sizes, source)
    if sum(sizes) != clients:
        raise ConfigError(f"{key}={list(sizes)} needs 1 + {' + '.join(map(str, sizes))} = {1 + sum(sizes)} ranks "
                          f"but the job has {world_size}; start it with --np {1 + sum(sizes)}")
    return SiteLayout(sizes)


def ranks_problem(value: int | list[int] | tuple[int, ...]) -> str | None:
    """What is wrong with ``ranks_per_site`` on its own (an int >= 1 or a non-empty list of them), or None."""
    sizes = [value] if isinstance(value, int) else list(value)
    if not sizes:
        return "=[] names no site; give R >= 1 or one R per site"
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        return f"={value!r}: every site needs at least 1 rank (R < 1 leaves a site without a leader); set R >= 1"
    return None


def check_ranks_per_site(value: int | list[int] | tuple[int, ...], source: str = "the config") -> None:
    """ConfigError naming `source` where ``ranks_per_site`` is wrong on its own (`ranks_problem`)."""
    problem = ranks_problem(value)
    if problem is not None:
        raise ConfigError(f"{source}: federation.ranks_per_site{problem}")


def world_size_for(ranks_per_site: int | list[int], num_clients: int | None) -> int | None:
    """`--np` for a config that names its sites (`num_clients`, or a per-site list); None if it does not."""
    if isinstance(ranks_per_site, list):
        return 1 + sum(ranks_per_site)
    return None if num_clients is None else 1 + num_clients * ranks_per_site
