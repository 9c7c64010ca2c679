"""What a chaos soak's run wrote, checked (`tools/chaos_soak.py`, and the suite's short soak).

From the server's metrics.jsonl (the run's one history: a resumed server drops the rounds after its
checkpoint and redoes them) and the sites' audit files (`hpcfed.privacy.audit`, written when the
environment sets ``HPCFED_AUDIT``):

- **rounds applied once**: every round's figures are there once, the rounds follow each other;
- **rounds applied rightly**: each sum folded is exactly the sum of the inputs of the sites it
  lists (mod 2³², from the linear probes); each round starts from the model the round before it
  ended with (across the server's resume too); and moves it by its own step, once (a lost round
  leaves it as it was);
- **rounds lost, each named**: from the server's log, the round and its cause.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from hpcfed.privacy import audit

MODEL_TOLERANCE = 1e-4  # float32 model, float64 probe: relative to the probe's scale


def events(out: Path) -> list[dict[str, Any]]:
    """The server's metrics.jsonl as records (a line cut by a kill is skipped)."""
    found = []
    with contextlib.suppress(OSError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


def lost_rounds(log_text: str) -> list[tuple[int, str]]:
    """(round, cause) of each round the server's log says it lost, in order, a resumed run's too."""
    return [(int(m.group(1)), " ".join(m.group(2).split(";")[0].split()[:24]))
            for m in re.finditer(r"round (\d+) lost: (.*)", log_text)]


def sites_not_back(log_text: str) -> list[int]:
    """The sites the server lost and never let back in afterwards, from its log (empty: every loss
    was followed by that site's return, as a rejoin, or in the gathering of a resumed server, whose
    "setup done" starts the count again). A site job killed before it knocked is no loss: the server
    never had it."""
    away: dict[int, bool] = {}
    for m in re.finditer(r"client (\d+) \(rank \d+\) (lost|is back|resumes from its own shard)|(setup done)",
                         log_text):
        if m.group(3):
            away.clear()
        else:
            away[int(m.group(1))] = m.group(2) == "lost"
    return sorted(c for c, gone in away.items() if gone)


def wrong_rounds(srv: Path, audit_dir: Path, num_sites: int) -> list[str]:
    """Each way a round was applied wrongly or twice, named (empty: every round was applied rightly)."""
    evs = events(srv)
    problems: list[str] = []
    times: dict[int, int] = {}
    for e in evs:
        if e["name"] == "round_time_s":
            times[e["round"]] = times.get(e["round"], 0) + 1
    problems += [f"round {r} applied {n} times" for r, n in sorted(times.items()) if n != 1]
    rounds = sorted(times)
    if rounds and rounds != list(range(rounds[0], rounds[-1] + 1)):
        problems.append(f"rounds missing from the history: {sorted(set(range(rounds[0], rounds[-1])) - set(rounds))}")
    model: dict[tuple[int, str], float] = {(e["round"], e.get("at", "")): e["value"]
                                           for e in evs if e["name"] == "audit_model"}
    step = {e["round"]: e["value"] for e in evs if e["name"] == "audit_step"}
    lost = {e["round"] for e in evs if e["name"] == "secagg_round_lost"}
    if rounds and not model:
        problems.append("no audit records: was HPCFED_AUDIT set for the server?")
    for r in rounds:
        start, end = model.get((r, "start")), model.get((r, "end"))
        if start is None or end is None:
            problems.append(f"round {r}: no model probe")
            continue
        scale = 1.0 + abs(start) + abs(end)
        before = model.get((r - 1, "end"))
        if before is not None and abs(start - before) > MODEL_TOLERANCE * scale:
            problems.append(f"round {r} starts from {start:.6g}, not the model round {r - 1} ended with ({before:.6g})")
        moved = end - start
        want = 0.0 if r in lost and r not in step else step.get(r)
        if want is None:
            problems.append(f"round {r} moved the model by {moved:.6g} with no step folded")
        elif abs(moved - want) > MODEL_TOLERANCE * (scale + abs(want)):
            problems.append(f"round {r} moved the model by {moved:.6g}, not by its step {want:.6g}")
    inputs = {cid: audit.site_inputs(audit_dir, cid) for cid in range(num_sites)}
    for e in evs:
        if e["name"] != "audit_sum":
            continue
        members = [int(m) for m in e.get("members", [])]
        probes = [inputs[m].get(e["round"]) for m in members if 0 <= m < num_sites]
        if len(probes) != len(members) or any(p is None for p in probes):
            problems.append(f"round {e['round']}: the sum lists sites {members}, not all of which recorded an input")
        elif not audit.sums_match([p for p in probes if p is not None], int(e["value"])):
            problems.append(f"round {e['round']}: the sum folded is not the sum of sites {members}' inputs")
    return problems


def rejoin_rounds(srv: Path) -> list[dict[str, Any]]:
    """Each site let back in (a ``rejoined`` event with its knock's time), from the server's
    metrics.jsonl: which site, the seconds from its knock to its setup done (``let_in_s``), and how
    soon its upload was folded after its knock.

    - sync: ``rounds`` = the round that first folded its upload minus the round in progress when
      its knock came (1: the next round; 0: the round it knocked in, which was still waiting);
    - async: ``before_admit`` = uploads folded between its knock and the step that let it in (0: it
      was let in at once), ``others_before_first`` = uploads of other sites folded between then and
      its own first one (one round of the others is K - 1).
    A rejoin whose first upload is not in the file yet (the run ended first) has None."""
    evs = events(srv)
    ended = sorted((e["time"], e["round"]) for e in evs if e["name"] == "round_time_s")  # sync rounds, as they ended
    accepted = sorted((e["time"], e["round"]) for e in evs if e["name"] == "broadcast")  # async uploads, as folded
    trained = [(e["round"], e["client"]) for e in evs if e["name"] == "train_loss" and e["client"] is not None]
    found = []
    for e in evs:
        if e["name"] != "rejoined" or "knock_time" not in e:
            continue
        cid, start, knock = e["client"], e["value"], e["knock_time"]
        mine = sorted(r for r, c in trained if c == cid and r >= start)
        row: dict[str, Any] = {"site": cid, "knock_time": knock, "let_in_s": round(e["time"] - knock, 2),
                               "let_in_from": start}
        if ended:  # sync: the rounds are numbered, each ends once
            in_progress = next((r for t, r in ended if t > knock), None)
            row["rounds"] = mine[0] - in_progress if mine and in_progress is not None else None
        else:
            at_knock = max((r for t, r in accepted if t <= knock), default=0)
            row["before_admit"] = start - at_knock
            first = next((r for r in mine if r > start), None)
            row["others_before_first"] = None if first is None else first - start - 1
        found.append(row)
    return found
