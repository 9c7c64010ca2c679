"""The importers' --columns mapping: every malformed spec is refused, naming the item."""

from __future__ import annotations

import pytest

from hpcfed.data.columns import parse_columns
from hpcfed.data.messages import COLUMNS
from hpcfed.data.root import DataError


def test_a_spec_maps_our_names_to_the_files():
    assert parse_columns("id=tweet_id, text = Tweet Text", COLUMNS) == {"id": "tweet_id", "text": "Tweet Text"}
    assert parse_columns(None, COLUMNS) == {}


@pytest.mark.parametrize("spec, message", [
    ("id", "'id' is not NAME=COLUMN"),
    ("id=a,id=b", "'id' is mapped twice"),
    ("tweet=a", "'tweet' is not a column of the format"),
    ("id=", "is not NAME=COLUMN"),
])
def test_bad_column_specs_name_the_item(spec: str, message: str) -> None:
    with pytest.raises(DataError, match=message):
        parse_columns(spec, COLUMNS)
