"""``hpcfed keygen PATH [--rank N] [--force] [--comment TEXT]``: a site's (or the server's) identity.

It writes PATH (the Ed25519 private key, 0600) and PATH.pub (`hpcfed.comm.keys`) and prints the
line for the server's ``security.authorized_keys``, bound to the site's rank: ready to paste with
``--rank N``, else with ``rank=N`` to fill in.
"""

from __future__ import annotations

import argparse

SUMMARY = "make an identity key; print its authorized_keys line"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcfed keygen", description=SUMMARY)
    p.add_argument("path", help="the private key to write (PATH.pub gets the public half)")
    p.add_argument("--rank", type=int, default=None,
                   help="the MPI rank the site runs as (1..K): the printed line carries rank=N, ready to paste")
    p.add_argument("--force", action="store_true", help="overwrite an existing key")
    p.add_argument("--comment", default=None, help="the key's comment (default user@host)")
    return p


def authorized_line(public_line: str, rank: int | None) -> str:
    """The authorized_keys line of a .pub line: ``hpcfed-ed25519 <base64> rank=N [comment]``."""
    kind, b64, *comment = public_line.split(None, 2)
    return " ".join([kind, b64, f"rank={'N' if rank is None else rank}", *comment])


def main(argv: list[str]) -> int:
    """`hpcfed keygen PATH`: write the identity and print the line the server's authorized_keys needs."""
    args = _parser().parse_args(argv)
    if args.rank is not None and args.rank < 1:
        raise ValueError(f"--rank {args.rank}: a site runs as rank 1..K (rank 0 is the server, which is listed "
                         f"in no authorized_keys: sites pin its .pub as security.server_public_key)")
    from hpcfed.comm.keys import generate_identity

    line = generate_identity(args.path, overwrite=args.force, comment=args.comment)
    print(f"wrote {args.path} (private, mode 0600) and {args.path}.pub")
    if args.rank is None:
        print("add this line to the server's authorized_keys file, with N = the MPI rank this site runs as "
              "(or run keygen with --rank N):")
    else:
        print("add this line to the server's authorized_keys file:")
    print(authorized_line(line, args.rank))
    return 0
