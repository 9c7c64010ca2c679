"""How a federation ends: the final evaluation round and ``summary.json``, or a halt to resume later.

At the end every live site gets its final model (FINAL), evaluates and exports it, and answers with
its test metrics and its cost (RESULT); a site that misses the deadline is reported, the others'
results are kept. The summary holds the mean of each metric over the sites, per site figures,
rejections, costs and the config.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.cost import rank_cost
from hpcfed.server import validation as V
from hpcfed.server.core import ServerCore
from hpcfed.store import atomic

log = logging.getLogger("hpcfed.server")

Results = dict[int, dict[str, float]]  # client id -> its final metrics


def halt(core: ServerCore, rnd: int) -> dict[str, Any]:
    """Stop every rank cleanly after round `rnd` (halt_after_round, SIGUSR2, OUT/HALT); resume with --resume."""
    core.stop_all(f"halted after round {rnd}")
    log.info("halted after round %d as asked (halt_after_round, SIGUSR2 or OUT/HALT); checkpoint %s", rnd,
             core.last_checkpoint)
    core.metrics.close()
    return {"halted_after_round": rnd, "last_checkpoint": str(core.last_checkpoint)}


def below_floor(core: ServerCore, why: str) -> dict[str, Any]:
    """Evictions left too few sites (federation.min_sites): stop every rank, keep the last
    checkpoint, and say so in summary.json; the job itself ends cleanly."""
    core.stop_all("too few sites left")
    log.error("%s", why)
    # The sites were mid-round: take (and drop) what they are still sending, so none of them waits
    # on rank 0 after it is gone; a site quiet for a second is done.
    until = time.monotonic() + core.config.deadlines.round_deadline_s
    while time.monotonic() < until and core.channel.recv(timeout=1.0) is not None:
        pass
    membership = core.roster.report(core.round + 1)
    summary = {"stopped": why, "evicted": membership["evicted"], "dropped": membership["dropped"],
               "dropped_clients": sorted(core.departures.dropped), "last_checkpoint":
               str(core.last_checkpoint) if core.last_checkpoint else None, "round": core.round,
               "channel": core.channel.stats.as_dict(), "rejected": {"runtime": core.rejected}}
    atomic.write_text(core.out_dir / "summary.json", json.dumps(summary, indent=2, default=str))
    core.metrics.close()
    return summary


def finish(core: ServerCore) -> dict[str, Any]:
    """The final evaluation round; writes and returns summary.json, and lets every rank go."""
    for cid in sorted(core.live):
        core.send_to(cid, P.FINAL, {"round": core.round, "version": core.strategy.version},
                     core.model_tensors(core.strategy.final_model_for(cid)))
    results, costs, missing = _collect_results(core)
    for cid in sorted(results):
        core.metrics.log_many(core.round, cid, {f"final_{k}": v for k, v in results[cid].items()})
    core.stop_all("done")
    summary = summarize(core, results, costs, missing)
    atomic.write_text(core.out_dir / "summary.json", json.dumps(summary, indent=2, default=str))
    core.metrics.close()
    return summary


def _collect_results(core: ServerCore) -> tuple[Results, dict[int, dict[str, Any] | None], list[int]]:
    """Each live site's RESULT until all are in or the deadline passes: their metrics, their costs,
    and the sites that sent none in time."""
    fed = core.config.deadlines
    results: Results = {}
    costs: dict[int, dict[str, Any] | None] = {}
    deadline = time.monotonic() + fed.round_deadline_s
    while len(results) < len(core.live):
        msg = core.recv_until(deadline, {P.RESULT, P.UPDATE, P.FAILED}, "the final evaluation",
                              waiting_for=core.live - set(results), fatal=not results)
        if msg is None:  # a straggler missed the final deadline: report it, keep the others' results
            late = sorted(core.live - set(results))
            log.warning("final evaluation: no result within %g s from %s", fed.round_deadline_s,
                        ", ".join(f"client {c} (rank {c + 1})" for c in late))
            return results, costs, late
        if msg.kind == P.UPDATE:
            continue  # an async client's last upload, overtaken by the stop
        if msg.source - 1 not in core.live:
            core.reject(msg.source, "not a member", "RESULT from a client that is not part of the federation")
            continue
        parsed = V.parse_result(msg.header)
        if isinstance(parsed, V.Rejection):
            core.reject(msg.source, parsed.category, parsed.detail)
            continue
        results[msg.source - 1], costs[msg.source - 1] = parsed
    return results, costs, []


def summarize(core: ServerCore, results: Results, costs: dict[int, dict[str, Any] | None],
              missing: list[int]) -> dict[str, Any]:
    """summary.json: the mean of each final metric over the sites (also at the top level), then
    per site results, who was missing or dropped, and the run's figures."""
    names = sorted({k for r in results.values() for k in r})
    mean = {}
    for k in names:
        vals = [r[k] for r in results.values() if k in r and math.isfinite(r[k])]
        mean[k] = float(np.mean(vals)) if vals else None
    stats = core.channel.stats
    _warn_if_partial(core, sorted(results))
    summary = {
        **mean,
        "mean": mean,
        "mean_over": sorted(results),  # the sites whose final results the mean is taken over
        "clients": {str(c): results[c] for c in sorted(results)},
        "missing_clients": missing,
        # dropped_clients, dropped, participation, evicted: who was in, and why not
        **core.roster.report(core.updates_accepted if not core.strategy.synchronous else core.round + 1),
        # per site, how the server's big messages reached it: "ring" (shared memory, same node),
        # "declined" (ring refused: another node or no room) or "mpi" (no ring offered)
        "transport": {str(rank - 1): route for rank, route in sorted(core.channel.routes().items())},
        "rounds": core.config.run.rounds,
        "updates_accepted": core.updates_accepted,
        # secure aggregation rounds lost: too many sites of one neighbourhood left, nothing of them folded
        "lost_rounds": list(core.lost_rounds),
        "server_version": core.strategy.version,
        "wall_time_s": core.metrics.elapsed(),
        "server_cpu_s": time.process_time() - core.cpu0,
        # per rank ("0" is the server): peak RSS, channel bytes, seconds in AES-GCM; null for a
        # client whose RESULT carried none
        "cost": {"0": rank_cost(stats, core.loop_cpu_s), **{str(c + 1): costs.get(c) for c in range(core.num_clients)}},
        # per site: training examples per second of its rounds' training, all of its ranks together
        "throughput": {str(c): cost["examples_per_s"] for c, cost in sorted(costs.items())
                       if cost and "examples_per_s" in cost},
        "rejected": {"runtime": core.rejected, "channel": dict(stats.rejected)},
        "clipped_updates": core.influence.clipped,
        # the largest upload distance / max(typical, the site's own recent): refused (and counted) beyond
        # influence.reject_factor; an honest run stays far below it (docs/threats.md)
        "influence_peak_ratio": round(core.influence.peak_ratio, 4),
        "channel": stats.as_dict(),  # the server's traffic: bytes per run, per round
        "last_checkpoint": str(core.last_checkpoint) if core.last_checkpoint else None,
        "config": core.config.run.recorded,
        "config_hash": core.config.run.config_hash,
        **({"privacy": {"secure_aggregation": True, "epsilon": None}}
           if core.config.privacy.secure_aggregation else {}),
        **core.strategy.report(),  # DP-FedAvg: "privacy" (ε, δ, z, C, rounds)
    }
    if core.config.privacy.record_dp is not None:
        summary.setdefault("privacy", {})["record_dp"] = record_dp_report(results)
    return summary


def record_dp_report(results: Results) -> dict[str, Any]:
    """summary.json privacy.record_dp: each site's ε from its final RESULT, their max, and δ (the
    largest of the sites', as each site's default δ follows its own record count)."""
    sites = {str(c): r["record_dp_epsilon"] for c, r in sorted(results.items()) if "record_dp_epsilon" in r}
    deltas = [r["record_dp_delta"] for r in results.values() if "record_dp_delta" in r]
    return {"delta": max(deltas) if deltas else None, "epsilon": max(sites.values()) if sites else None,
            "sites": sites}


def _warn_if_partial(core: ServerCore, over: list[int]) -> None:
    """Say on the console when the mean leaves a site out (evicted, dropped, or no result in time)."""
    left_out = sorted(set(range(core.num_clients)) - set(over))
    if left_out:
        log.warning("the final mean is over %d of %d sites; left out: %s", len(over), core.num_clients,
                    ", ".join(f"client {c} ({_why_out(core, c)})" for c in left_out))


def _why_out(core: ServerCore, cid: int) -> str:
    state = core.roster.state(cid)
    return "no result in time" if state == "present" else state
