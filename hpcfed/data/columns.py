"""``--columns ours=theirs,...``: the importers' mapping from the documented column names to a file's own."""

from __future__ import annotations

from hpcfed.data.root import DataError


def parse_columns(spec: str | None, allowed: tuple[str, ...], option: str = "--columns") -> dict[str, str]:
    """``id=tweet_id,text=tweet_text`` -> {"id": "tweet_id", "text": "tweet_text"}; DataError on a bad spec."""
    if not spec:
        return {}
    mapping: dict[str, str] = {}
    for item in spec.split(","):
        ours, sep, theirs = (part.strip() for part in item.partition("="))
        if not sep or not ours or not theirs:
            raise DataError(f"{option} {spec!r}: {item.strip()!r} is not NAME=COLUMN; write e.g. "
                            f"{option} id=tweet_id,text=tweet_text")
        if ours not in allowed:
            raise DataError(f"{option} {spec!r}: {ours!r} is not a column of the format; map one of "
                            f"{', '.join(allowed)}")
        if ours in mapping:
            raise DataError(f"{option} {spec!r}: {ours!r} is mapped twice")
        mapping[ours] = theirs
    return mapping
