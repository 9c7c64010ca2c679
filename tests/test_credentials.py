"""Credentials: the secret seeds derived from the job's key (DP noise must not follow from the config)."""

from __future__ import annotations

import pytest

from hpcfed.comm.keys import generate_identity
from hpcfed.config import ConfigError, SecurityConfig
from hpcfed.credentials import RankKeys


def secret_seed(sec: SecurityConfig, rank: int, purpose: str) -> int:
    return RankKeys(sec, rank).secret_seed(purpose)  # the keys read afresh each time


def test_secret_seed_follows_the_psk_and_purpose_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCFED_PSK", "11" * 32)
    sec = SecurityConfig()
    a = secret_seed(sec, 0, "dp-noise")
    assert a == secret_seed(sec, 0, "dp-noise")  # a resumed run draws the same noise
    assert a.bit_length() > 200 and a != secret_seed(sec, 0, "other")
    monkeypatch.setenv("HPCFED_PSK", "12" * 32)
    assert secret_seed(sec, 0, "dp-noise") != a  # another job's key, another noise


def test_secret_seed_in_keys_mode_comes_from_the_identity(tmp_path) -> None:
    generate_identity(tmp_path / "id0")
    sec = SecurityConfig(mode="keys", identity=str(tmp_path / "id{rank}"))
    assert secret_seed(sec, 0, "dp-noise") == secret_seed(sec, 0, "dp-noise")
    with pytest.raises(ConfigError, match=r"security\.identity"):
        secret_seed(SecurityConfig(mode="keys"), 0, "dp-noise")
