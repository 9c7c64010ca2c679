"""A site's upload pipeline (hpcfed.client.upload, .assemble): which stages a config installs, the
order they act in, the privacy stages' input bit for bit against `site_input.encode_update`, and a
malicious site's stages over a real sealed channel on the in-process transport (the test plays rank 0).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from hpcfed import protocol as P
from hpcfed.client import attacks
from hpcfed.client.assemble import eviction_hooks, upload_pipeline
from hpcfed.client.config import ClientConfig
from hpcfed.client.faults import STOP_AFTER_UPLOAD, StopAfterUpload
from hpcfed.client.privacy_stages import Clip, Delta, Encode, Noise
from hpcfed.client.secagg import SecAggSite
from hpcfed.client.upload import Pipeline, RoundStart, Send, Stage, Upload, Upstream
from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.transport import InProcTransport
from hpcfed.config import SecurityConfig, from_mapping
from hpcfed.credentials import RankKeys
from hpcfed.params import ParamLayout
from hpcfed.privacy.site_input import encode_update, input_spec
from hpcfed.registry import resolve

K = 3  # sites; the last (client 2, rank 3) is the one an ``attack=`` turns malicious
PSK = bytes(range(32))


def _config(*overrides: str) -> ClientConfig:
    cfg = from_mapping({"rounds": 2, "task": {"name": "synthetic"}, "federation": {"num_clients": K}},
                       list(overrides))
    resolve(cfg)
    return ClientConfig.from_config(cfg)


def _stages(rank: int, *overrides: str) -> list[type]:
    config = _config(*overrides)
    channel = SecureChannel(InProcTransport.group(K + 1)[rank], Credentials(mode="psk", psk=PSK), b"job-pipe")
    try:
        layout = ParamLayout.of({"w": np.zeros(4, np.float32)})
        attack = config.site.attack_played_by(rank - 1, K)
        pipeline = upload_pipeline(lambda start: Upload(round=0, params={}, num_examples=0, header={}), config,
                                   channel, layout, attack, RankKeys(SecurityConfig(), rank))
        return [type(stage) for stage in pipeline.stages]
    finally:
        channel.close()


@pytest.mark.parametrize(("rank", "overrides", "want"), [
    (1, [], [Send]),
    (3, ["attack=sign_flip"], [attacks.Tamper, Send]),
    (2, ["attack=sign_flip"], [Send]),  # only the last client plays the run's attack
    (3, ["attack=model"], [Send]),  # a task-defined attack is the task's, not a stage
    (3, ["attack=bad_header"], [attacks.MalformedSend]),
    (3, ["attack=bad_header_then_flood"], [attacks.MalformedSend]),
    (1, ["privacy.secure_aggregation=true", "influence.enabled=false"], [Delta, Clip, Encode, SecAggSite]),
    # distributed DP: Skellam noise (the default) is drawn on the grid by Encode; Gaussian has its stage
    (1, ["privacy.secure_aggregation=true", "influence.enabled=false", "privacy.dp.noise_multiplier=1.0"],
     [Delta, Clip, Encode, SecAggSite]),
    (1, ["privacy.secure_aggregation=true", "influence.enabled=false", "privacy.dp.noise_multiplier=1.0",
         "privacy.dp.noise=gaussian"], [Delta, Clip, Noise, Encode, SecAggSite]),
    (3, ["privacy.secure_aggregation=true", "influence.enabled=false", "attack=flood"],
     [attacks.Tamper, Delta, attacks.UnboundedEncode, SecAggSite]),
    # group testing's attacker: the honest clip and encoding, then random field elements in their place
    (3, ["privacy.secure_aggregation=true", "influence.enabled=false", "attack=garbage"],
     [Delta, Clip, Encode, attacks.Garbage, SecAggSite]),
    (3, ["attack=garbage"], [Send]),  # without secure aggregation it has nothing to garble
])
def test_the_config_installs_only_the_stages_it_asks_for(rank, overrides, want):
    assert _stages(rank, *overrides) == want


def test_only_a_then_flood_site_acts_after_its_eviction():
    # (what its flood does to the server: tests/server/test_eviction_mpi.py)
    assert eviction_hooks(None, None) == [] and eviction_hooks(None, "bad_header") == []
    (flood,) = eviction_hooks(None, "bad_header_then_flood")
    assert flood.func is attacks.flood_after_eviction


def test_a_fault_hook_is_a_stage_installed_only_when_its_environment_variable_is_set(monkeypatch):
    assert _stages(1) == [Send]
    monkeypatch.setenv(STOP_AFTER_UPLOAD, "1:5")
    assert _stages(1) == [Send, StopAfterUpload]


class _Trace(Stage):
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        self.events.append(f"{self.name} before")
        upload = upstream(start)
        self.events.append(f"{self.name} after")
        return upload


def _start(rnd: int = 0, received: dict | None = None, header: dict | None = None) -> RoundStart:
    received = received or {"w": np.zeros(4, np.float32)}
    return RoundStart(round=rnd, header=header or {}, received=received, current_model=lambda: received)


def test_stages_act_before_training_outermost_first_and_after_it_in_upload_order():
    events: list[str] = []

    def train(start: RoundStart) -> Upload:
        events.append("train")
        return Upload(round=start.round, params={}, num_examples=1, header={})

    Pipeline(train, [_Trace("clip", events), _Trace("mask", events)])(_start())
    assert events == ["mask before", "clip before", "train", "clip after", "mask after"]


@pytest.mark.parametrize("norm", [0.5, 100.0])  # clipped, and within C
@pytest.mark.parametrize("uniform", [False, True])
def test_the_privacy_stages_encode_the_input_encode_update_does_bit_for_bit(norm, uniform):
    rng = np.random.default_rng(7)
    sent, trained = rng.normal(size=50).astype(np.float32), rng.normal(size=50).astype(np.float32)
    spec = input_spec(K, clip_norm=norm, max_examples=1000)
    layout = ParamLayout.of({"w": sent})
    upload = Pipeline(lambda s: Upload(round=0, params={"w": trained.copy()}, num_examples=37, header={}),
                      [Delta(layout), Clip(norm), Encode(spec, uniform, 0)])(_start(received={"w": sent}))
    want, within = encode_update(np.subtract(trained, sent, dtype=np.float64), 1 if uniform else 37, spec)
    assert upload.codes is not None and np.array_equal(upload.codes, want) and upload.within == within
    assert within == (norm == 100.0)


@pytest.mark.parametrize(("attack", "garbled"), [
    ("garbage_weight", dict.fromkeys(range(3), slice(-1, None))),
    ("garbage_vector", dict.fromkeys(range(3), slice(None, -1))),
    ("garbage_once", {0: slice(None)}), ("garbage_alternate", {0: slice(None), 2: slice(None)}),
])
def test_a_garbage_stage_replaces_the_honest_input_in_the_parts_and_rounds_its_attack_picks(attack, garbled):
    rng = np.random.default_rng(3)
    sent, trained = rng.normal(size=200).astype(np.float32), rng.normal(size=200).astype(np.float32)
    spec = input_spec(K, clip_norm=1.0, max_examples=1000)
    layout = ParamLayout.of({"w": sent})
    honest = Pipeline(lambda s: Upload(round=s.round, params={"w": trained.copy()}, num_examples=37, header={}),
                      [Delta(layout), Clip(1.0), Encode(spec, False, 0)])
    hostile = Pipeline(lambda s: Upload(round=s.round, params={"w": trained.copy()}, num_examples=37, header={}),
                       [Delta(layout), Clip(1.0), Encode(spec, False, 0), attacks.Garbage(attack)])
    for rnd in range(3):
        want = honest(_start(rnd, received={"w": sent})).codes
        got = hostile(_start(rnd, received={"w": sent})).codes
        assert want is not None and got is not None
        changed = np.flatnonzero(got != want)
        part = garbled.get(rnd)
        expected = np.arange(want.size)[part] if part is not None else np.array([], dtype=int)
        # random uint32s: a coordinate left as it was has odds 2**-32 per coordinate
        assert np.array_equal(changed, expected), (rnd, changed[:5])


def test_under_distributed_dp_every_site_weighs_one_and_its_clipped_delta_is_noised():
    spec = input_spec(K, clip_norm=1.0, max_examples=1000, noise_multiplier=1.0)
    # 20,000 coordinates: the sample std's own error is 0.5 %, so the 5 % bound below is 10 sigma wide
    # (with 2,000 it was 3 sigma and failed about once in 2,000 runs).
    sent, trained = np.zeros(20_000, np.float32), np.full(20_000, 3.0, np.float32)  # ‖δ‖ = 424 > C: clipped
    layout = ParamLayout.of({"w": sent})
    upload = Pipeline(lambda s: Upload(round=0, params={"w": trained}, num_examples=37, header={}),
                      [Delta(layout), Clip(1.0), Noise(spec.noise_std), Encode(spec, False, 0)])(
        _start(received={"w": sent}))
    assert upload.codes is not None and upload.codes[-1] == 1 and not upload.within
    assert upload.delta is not None and upload.scale == 1.0
    # The clipped delta is 1/√20000 per coordinate; the noise's std z·C/√K is what is left around it.
    assert abs(float(np.std(upload.delta - 1 / np.sqrt(20_000))) - spec.noise_std) < 0.05 * spec.noise_std


def _connected() -> tuple[SecureChannel, SecureChannel]:
    """Rank 0 (the test's server) and rank 3 (client 2, the malicious one), connected."""
    ts = InProcTransport.group(K + 1)
    server, site = (SecureChannel(ts[r], Credentials(mode="psk", psk=PSK), b"job-pipe", log=lambda *_: None)
                    for r in (0, K))
    thread = threading.Thread(target=site.connect, args=([0],), kwargs={"timeout": 10})
    thread.start()
    server.connect([K], timeout=10)
    thread.join()
    server.expect(None)
    site.expect(None)
    return server, site


def _uploads(server: SecureChannel) -> list[Any]:
    out = []
    while (msg := server.recv(source=K, kinds={P.UPDATE}, timeout=2)) is not None:
        out.append(msg)
    return out


def test_a_sign_flipper_flips_the_step_from_the_model_as_received_even_when_training_works_in_place():
    server, channel = _connected()
    try:
        received = {"w": np.ones(4, np.float32)}
        layout = ParamLayout.of(received)

        def train_in_place(start: RoundStart) -> Upload:
            start.received["w"] += 0.5  # a task that trains the arrays it was given
            return Upload(round=0, params={"w": start.received["w"]}, num_examples=5, header={"round": 0})

        Pipeline(train_in_place, [attacks.Tamper("sign_flip"), Send(channel, layout)])(_start(received=received))
        (msg,) = _uploads(server)
        got = layout.unpack(P.params_groups(msg.tensors, layout.groups))["w"]
        assert np.array_equal(got, np.full(4, 1.0 - 10 * 0.5, np.float32)) and msg.header["num_examples"] == 5
    finally:
        channel.close()
        server.close()


def test_a_flooding_site_sends_each_upload_twenty_times_and_a_claim_rewrites_the_count():
    server, channel = _connected()
    try:
        layout = ParamLayout.of({"w": np.ones(4, np.float32)})
        pipe = Pipeline(lambda s: Upload(round=0, params={"w": np.ones(4, np.float32)}, num_examples=5,
                                         header={"round": 0}), [attacks.Tamper("flood"), Send(channel, layout)])
        pipe(_start())
        assert len(_uploads(server)) == attacks.FLOOD_COPIES
        Pipeline(lambda s: Upload(round=1, params={"w": np.ones(4, np.float32)}, num_examples=5, header={"round": 1}),
                 [attacks.Tamper("claim_examples"), Send(channel, layout)])(_start(1))
        (msg,) = _uploads(server)
        assert msg.header["num_examples"] == 10**12
    finally:
        channel.close()
        server.close()
