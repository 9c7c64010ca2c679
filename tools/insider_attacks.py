"""One malicious site among four, under the DEFAULT configuration: what does it cost the honest sites?

Runs the quickstart (configs/quickstart.yaml, sync FedAvg) under real `mpiexec -n 5` with the last
client playing each runtime attack (`hpcfed.client.attacks`), plus, against FedAsync, a flood of
unrequested updates and a sign-flipper that trains 4x as fast as the honest sites (so that it would
make most of the uploads), and prints the honest sites' mean test accuracy beside the no-attack run
of the same mode:

    python tools/insider_attacks.py [--json] [--out DIR] [--secure-aggregation] [key=value ...]

Overrides apply to every run (e.g. `influence.clip_factor=2` to measure another bound).

`--secure-aggregation` runs the synchronous cases twice, side by side: as configured, and with
`privacy.secure_aggregation=true` (and `influence.enabled=false`: the guard cannot see one site's
update). There the attacks act on the malicious site's input before masking (it skips its own clip
and count bound, `hpcfed.client.attacks.unbounded_input`); what bounds it is the fixed-point range
and the server's check of the sum's norm (rounds refused: `secagg_sum_refused` in metrics.jsonl).

Goal (issue 12): the honest mean drops by at most 0.05 in every case, summary.json names no
honest client as failed or dropped, and the server refused none of their messages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
NUM_RANKS = 5  # server + 3 honest sites + 1 malicious site
HONEST = ("0", "1", "2")
ASYNC = ["strategy.name=fedasync", "~strategy.weighting"]  # an asynchronous strategy: an async run
# The attacker trains 4x as fast as each honest site: it would make most of the async uploads.
SLOW_HONEST = [*ASYNC, "federation.slowdown={0: 4, 1: 4, 2: 4}"]
# FedDWA keeps every site's last upload (S_W): the hostile one that arrives first must leave with its site.
DWA_SLOW = ["strategy.name=feddwa", "~strategy.weighting", "federation.slowdown={0: 4, 1: 4, 2: 4}"]
CASES = [  # (name, mode: the no-attack run each attack is compared with, overrides, attack)
    ("no attack", "sync", [], None),
    ("constant model, num_examples=1e12", "sync", [], "claim_examples"),
    ("parameters x1e30", "sync", [], "scale"),
    ("sign-flipped step x10", "sync", [], "sign_flip"),
    ("20 copies of each upload", "sync", [], "flood"),
    ("async: no attack", "async", ASYNC, None),
    ("async: flood of unrequested updates", "async", ASYNC, "flood"),
    ("async, honest 4x slower: no attack", "async-slow", SLOW_HONEST, None),
    ("async, honest 4x slower: sign flip x10", "async-slow", SLOW_HONEST, "sign_flip"),
    ("async FedDWA, honest 4x slower: no attack", "async-dwa", DWA_SLOW, None),
    ("async FedDWA: constant model first, then a copy", "async-dwa", DWA_SLOW, "constant_twice"),
]
SECAGG = ["privacy.secure_aggregation=true", "influence.enabled=false"]
_REJECTED = re.compile(r"rejected message from rank (\d+)")


def run_case(out: Path, overrides: list[str], attack: str | None, timeout: float = 600,
             common: Sequence[str] = ()) -> dict:
    """Run one federation; return its summary.json (or the failure)."""
    cfg = QUICKSTART
    if "~strategy.weighting" in overrides:  # FedAsync has no weighting option
        text = QUICKSTART.read_text().replace("  weighting: num_examples\n", "")
        cfg = out.parent / "quickstart_async.yaml"
        cfg.write_text(text)
        overrides = [o for o in overrides if not o.startswith("~")]
    args = [*overrides, *common, *([f"attack={attack}"] if attack else [])]
    env = {**os.environ, "HPCFED_PSK": os.environ.get("HPCFED_PSK") or secrets.token_hex(32)}
    cmd = [shutil.which("mpiexec") or "mpiexec", "-n", str(NUM_RANKS), sys.executable, "-m", "hpcfed", "run",
           str(cfg), "--out", str(out), "--force", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    summary_path = out / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
        return {"failed": True, "rc": proc.returncode, "last_line": last[0]}
    return json.loads(summary_path.read_text())


def honest_rejected(out: Path) -> int:
    """How many of the honest sites' messages the server refused (from its log)."""
    try:
        text = (out / "logs" / "rank0.log").read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for rank in _REJECTED.findall(text) if str(int(rank) - 1) in HONEST)


def sums_refused(out: Path) -> int:
    """Rounds whose securely aggregated sum the server refused (metrics.jsonl)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for line in lines if '"secagg_sum_refused"' in line)


def honest_mean(summary: dict) -> float | None:
    """Mean accuracy of the honest sites, or None unless every one of them reported."""
    accs = [summary["clients"][c]["accuracy"] for c in HONEST if c in summary.get("clients", {})]
    return sum(accs) / len(accs) if len(accs) == len(HONEST) else None


def main() -> None:
    """Run every attack case against its baseline and print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--secure-aggregation", action="store_true",
                        help="the synchronous cases, each as configured and with secure aggregation")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="insider_"))
    root.mkdir(parents=True, exist_ok=True)
    cases = [(name, mode, overrides, attack, []) for name, mode, overrides, attack in CASES]
    if args.secure_aggregation:
        cases = [c for (name, mode, overrides, attack) in CASES if mode == "sync"
                 for c in ((name, mode, overrides, attack, []), (name, "sync+secagg", overrides, attack, SECAGG))]
    rows, baseline = [], {}
    for i, (name, mode, overrides, attack, extra) in enumerate(cases):
        summary = run_case(root / f"case{i}", [*overrides, *extra], attack, common=args.overrides)
        mean = None if summary.get("failed") else honest_mean(summary)
        if attack is None:
            baseline[mode] = mean
        blamed = sorted(set(map(str, summary.get("dropped_clients", []) + summary.get("missing_clients", [])))
                        & set(HONEST))
        drop = None if mean is None or baseline.get(mode) is None else baseline[mode] - mean
        rows.append({"case": name, "mode": mode, "attack": attack, "honest_mean_accuracy": mean,
                     "drop": drop, "honest_blamed": blamed, "failed": summary.get("failed", False),
                     "last_line": summary.get("last_line"),
                     "rejected": summary.get("rejected", {}).get("runtime"),
                     "honest_rejected": honest_rejected(root / f"case{i}"),
                     "clipped_updates": summary.get("clipped_updates"),
                     "sums_refused": sums_refused(root / f"case{i}"),
                     "evicted": [e.get("client") for e in summary.get("evicted", [])]})
    ok = all(r["drop"] is not None and r["drop"] <= 0.05 and not r["honest_blamed"] and not r["honest_rejected"]
             for r in rows if r["attack"])
    if args.json:
        print(json.dumps({"cases": rows, "goal_met": ok}, indent=2))
        return
    print(f"{'case':42} {'mode':11} {'honest acc':>10} {'drop':>7}  rejected (of them honest) / clipped / "
          f"sums refused / evicted")
    for r in rows:
        acc = "failed" if r["honest_mean_accuracy"] is None else f"{r['honest_mean_accuracy']:.3f}"
        drop = "" if r["drop"] is None else f"{r['drop']:+.3f}"
        print(f"{r['case']:42} {r['mode']:11} {acc:>10} {drop:>7}  {r['rejected']} ({r['honest_rejected']}) / "
              f"{r['clipped_updates']} / {r['sums_refused']} / {r['evicted']}"
              + (f"  ({r['last_line']})" if r["failed"] else ""))
    print(f"goal (every drop <= 0.05, no honest site blamed or refused): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
