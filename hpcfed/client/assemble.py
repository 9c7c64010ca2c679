"""The upload pipeline a site's config asks for (`hpcfed.client.upload`), assembled once the model's
layout is known (after the setup exchange). Each stage is installed only when configured:

    plain:              train -> [Tamper] -> Send | MalformedSend -> [faults]
    secure aggregation: train -> [Tamper] -> Delta -> Clip -> [Noise] -> Encode -> SecAggSite -> [faults]
    secure, async:      train -> Delta -> Clip -> BufferedSecAggSite (weighs, encodes, masks) -> [faults]
                        (garbage*: BufferedSecAggSite masks random field elements in place of its input)
    malicious, masked:  train -> Tamper -> Delta -> UnboundedEncode -> SecAggSite -> [faults]
    garbage, masked:    train -> Delta -> Clip -> [Noise] -> Encode -> Garbage -> SecAggSite -> [faults]

`Noise` is distributed DP (``privacy.dp`` with ``privacy.secure_aggregation``); in central DP the
server clips and noises (`hpcfed.strategies.dp_fedavg`) and the site uploads its model as it is.
The attacks (``attack=``, the last client only: `hpcfed.client.attacks`) and the fault hooks
(`hpcfed.client.faults`) are stages like any other. What a site does when the server evicts it
(`eviction_hooks`) is known from the start, before the setup exchange that may evict it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from hpcfed.client import attacks
from hpcfed.client.config import ClientConfig
from hpcfed.client.faults import fault_stages
from hpcfed.client.privacy_stages import Clip, Delta, Encode, Noise
from hpcfed.client.secagg import SecAggSite
from hpcfed.client.secagg_buffer import BufferedSecAggSite
from hpcfed.client.upload import Pipeline, Send, Stage, Upstream
from hpcfed.comm.api import Channel
from hpcfed.credentials import RankKeys
from hpcfed.params import ParamLayout
from hpcfed.privacy.site_input import spec_for


def upload_pipeline(train: Upstream, config: ClientConfig, channel: Channel, layout: ParamLayout,
                    attack: str | None, keys: RankKeys | None = None) -> Pipeline:
    """`train` wrapped by the stages `config` asks for on this site (`attack`: the one it plays, if any;
    `keys`: this rank's, read from `config.security` when not given)."""
    runtime_attack = attack if attack in attacks.RUNTIME_ATTACKS else None
    stages: list[Stage] = [attacks.Tamper(runtime_attack)] if runtime_attack else []
    if config.upload.privacy.secure_aggregation:
        garbage = attack if attack in attacks.GARBAGE_ATTACKS else None
        stages += _secagg_stages(config, channel, layout, runtime_attack or garbage,
                                 keys or RankKeys(config.security, channel.rank))
    elif attack in attacks.MALFORMED_ATTACKS:
        stages.append(attacks.MalformedSend(channel, layout, attack))
    else:
        stages.append(Send(channel, layout))
    return Pipeline(train, stages + fault_stages(channel.rank))


def eviction_hooks(channel: Channel, attack: str | None) -> list[Callable[[], None]]:
    """What this site does after the server evicted it (`attack`: the one it plays, if any): nothing,
    unless it floods anyway (``bad_header_then_flood``)."""
    return [functools.partial(attacks.flood_after_eviction, channel)] if attack == "bad_header_then_flood" else []


def _secagg_stages(config: ClientConfig, channel: Channel, layout: ParamLayout, attack: str | None,
                   keys: RankKeys) -> list[Stage]:
    """Delta, clip, [noise], encode, mask and send; a malicious site's input is neither clipped nor
    bounded (a runtime attack), or is random field elements after the encoding (``garbage*``)."""
    up, num_sites = config.upload, channel.size - 1
    spec = spec_for(up.privacy, num_sites, up.quorum)
    stages: list[Stage] = [Delta(layout)]
    if attack in attacks.RUNTIME_ATTACKS:
        stages.append(attacks.UnboundedEncode(spec, up.uniform_weighting))
    else:
        stages.append(Clip(spec.clip_norm))
        if spec.noise_std > 0 and not spec.discrete:  # Skellam noise is drawn on the grid, by Encode
            stages.append(Noise(spec.noise_std))
        stages.append(Encode(spec, up.uniform_weighting, channel.rank - 1))
        if attack is not None:  # a garbage* attack (group testing's attacker: docs/threats.md)
            stages.append(attacks.Garbage(attack))
    if up.mode == "async":  # FedBuff's buffers: the site weighs and encodes once its buffer tells it its staleness
        return [stages[0], Clip(spec.clip_norm), BufferedSecAggSite(
            channel, layout.size, keys=keys, degree=up.privacy.secagg.degree, timeout_s=up.client_timeout_s,
            spec=spec, rule=up.staleness, garbage=attack if attack in attacks.GARBAGE_ATTACKS else None)]
    site = SecAggSite(channel, layout.size, keys=keys, degree=up.privacy.secagg.degree,
                      min_group=up.privacy.secagg.min_group, timeout_s=up.client_timeout_s)
    return [*stages, site]

