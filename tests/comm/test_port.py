"""The MPI settings of a job joined to others through a port (`hpcfed.comm.port.network_env`)."""

from __future__ import annotations

from hpcfed.comm.port import network_env


def test_a_joined_job_talks_tcp_through_libfabric_unless_the_user_chose_otherwise():
    assert network_env(None, None, {}) == {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    assert network_env((50100, 50199), "ib0", {"MPIR_CVAR_CH4_NETMOD": "ucx", "FI_PROVIDER": "verbs"}) == {
        "FI_TCP_PORT_LOW_RANGE": "50100", "FI_TCP_PORT_HIGH_RANGE": "50199", "FI_TCP_IFACE": "ib0"}
