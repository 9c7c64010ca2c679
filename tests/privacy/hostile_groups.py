"""A test-side hostile rank 0 for group testing (tests/runtime/test_group_testing_mpi.py), started
under mpiexec in place of ``python -m hpcfed``: ``hostile_groups.py GROUPS hpcfed-args...``.

On rank 0 only, the retry of the round whose sum was first refused asks for GROUPS (JSON, e.g. ``[[0], [1, 2,
3, 4, 5]]`` or overlapping groups) instead of what group testing picks, skipping the server's own
check: the sites must refuse, naming the rule. The sites run the real code unchanged.

Only the test uses this file; nothing in hpcfed imports it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's hpcfed, not an installed one


def main() -> None:
    groups, args = json.loads(sys.argv[1]), sys.argv[2:]
    if int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
        from hpcfed.server import secagg_groups

        honest = secagg_groups.GroupTesting.start

        def start(self: secagg_groups.GroupTesting, rnd: int) -> list[list[int]] | None:
            if honest(self, rnd) is None:
                return None
            self.groups = [frozenset(g) for g in groups]
            return groups

        secagg_groups.GroupTesting.start = start  # type: ignore[method-assign]  # the hostile server's pick
    from hpcfed.cli import main as cli_main

    sys.exit(cli_main(args))


if __name__ == "__main__":
    main()
