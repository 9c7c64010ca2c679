"""Channel settings: checked where they are made, with the configuration key in the message."""

from __future__ import annotations

import pytest

from hpcfed.comm import wire
from hpcfed.comm.frame import HDR, TAG
from hpcfed.comm.options import ChannelOptions


@pytest.mark.parametrize("bad, key", [
    ({"chunk_bytes": 4095}, "comm.chunk_bytes"),
    ({"chunk_bytes": 1 << 31}, "comm.chunk_bytes"),
    ({"max_message_bytes": 0}, "comm.max_message_bytes"),
    ({"backoff_max_s": 0.0}, "comm.backoff_max_s"),
    ({"backoff_max_s": 1.5}, "comm.backoff_max_s"),
    ({"max_rejects": 0}, "security.max_rejects"),
])
def test_bad_settings_are_refused_naming_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        ChannelOptions(**bad)


def test_the_message_bound_never_exceeds_the_wire_limit_and_frames_fit_a_chunk():
    opts = ChannelOptions(max_message_bytes=1 << 40, limits=wire.WireLimits(max_total_bytes=1 << 20), chunk_bytes=8192)
    assert opts.max_message_bytes == 1 << 20
    assert opts.max_frame == HDR + 8192 + TAG
    with pytest.raises(TypeError):
        ChannelOptions(4096)  # type: ignore[misc]  # keyword-only
