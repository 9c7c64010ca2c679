"""Federated LoRA on 20 Newsgroups: federated vs local-only vs centralized per site, and bytes per round.

    python3 tools/lora_20ng_table.py [--config configs/lora_20ng.yaml] [--out runs/lora_20ng_table] [key=value ...]

Runs real federations (``hpcfed run``), each one reused when its ``summary.json`` exists:

- ``federated``: the config as is (FedAvg over K = `task.sites` or 3 sites, adapters + head travel);
- ``fedper``: the same with ``task.share_patterns=["*.lora_*"]``: only the adapters travel, every site
  keeps its own head (FedPer, Arivazhagan et al. 2019), fitted to its own label mix;
- ``local``: the same sites with ``strategy.name=local`` (every site trains alone);
- ``centralized``: one site holding the union of the K sites' training posts, scored on each site's test posts;
- bytes: four one- and two-round runs on a few posts (the traffic does not depend on the data) with
  LoRA exchange and with ``task.share=all`` (every weight of the same model travels); bytes per round
  is the server's channel traffic (sent + received, ``summary.json: channel``) of 2 rounds minus 1 round.

Writes OUT/table.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SITES = 3


def run(config: str, out: Path, np_: int, overrides: list[str]) -> dict:
    """The run's summary.json, running the federation first if it has none."""
    summary = out / "summary.json"
    if not summary.exists():
        cmd = [sys.executable, "-m", "hpcfed", "run", config, "--np", str(np_), "--out", str(out), "--force",
               *overrides]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return json.loads(summary.read_text())


def traffic(summary: dict) -> int:
    """Bytes the server sent and received over the whole run."""
    channel = summary["channel"]
    return int(channel["bytes_sent"]) + int(channel["bytes_received"])


def main(argv: list[str] | None = None) -> int:
    """Run the LoRA comparisons and the traffic probes, write OUT/table.md and print it; exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/lora_20ng.yaml")
    ap.add_argument("--out", default="runs/lora_20ng_table")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args(argv)
    out, sets = Path(args.out), list(args.overrides)

    fed = run(args.config, out / "federated", SITES + 1, sets)
    fedper = run(args.config, out / "fedper", SITES + 1, [*sets, 'task.share_patterns=["*.lora_*"]'])
    local = run(args.config, out / "local", SITES + 1, [*sets, "strategy.name=local"])
    central = run(args.config, out / "centralized", 2, [*sets, "task.centralized=true", f"task.sites={SITES}"])
    tiny = ["task.train_docs=16", "task.val_docs=8", "task.test_docs=8", "task.global_test_docs=0", "eval_every=0"]
    per_round = {}
    for mode, extra in (("lora", []), ("full", ["task.share=all"])):
        one = run(args.config, out / f"bytes_{mode}_r1", SITES + 1, [*sets, *tiny, *extra, "rounds=1"])
        two = run(args.config, out / f"bytes_{mode}_r2", SITES + 1, [*sets, *tiny, *extra, "rounds=2"])
        per_round[mode] = traffic(two) - traffic(one)

    cfg = fed["config"]["task"]["options"]
    lines = [f"Federated LoRA fine-tuning, 20 Newsgroups, {SITES} label-skewed sites "
             f"(Dirichlet {cfg.get('label_skew', 0.5)}), {fed['rounds']} rounds; "
             f"options {json.dumps(cfg, sort_keys=True)}", "",
             "Accuracy on each site's own test posts (its label mix) and on one balanced sample of the test split:", "",
             "| site | federated | federated, local heads | local-only | centralized | fed. - local "
             "| fed. local heads - local | federated (balanced) | fed. local heads (balanced) "
             "| local-only (balanced) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for k in range(SITES):
        f, fp, lo = fed["clients"][str(k)], fedper["clients"][str(k)], local["clients"][str(k)]
        c = central["clients"]["0"].get(f"site{k}_accuracy", nan)
        lines.append(f"| {k} | {f['accuracy']:.3f} | {fp['accuracy']:.3f} | {lo['accuracy']:.3f} | {c:.3f} "
                     f"| {f['accuracy'] - lo['accuracy']:+.3f} | {fp['accuracy'] - lo['accuracy']:+.3f} "
                     f"| {f.get('global_accuracy', nan):.3f} | {fp.get('global_accuracy', nan):.3f} "
                     f"| {lo.get('global_accuracy', nan):.3f} |")
    central_global = central["clients"]["0"].get("global_accuracy", nan)
    lines += ["", f"centralized on the global test: {central_global:.3f}", "",
              "| exchange | bytes per round (server, sent + received) | ratio |", "|---|---|---|",
              f"| LoRA adapters + head | {per_round['lora']:,} | 1 |",
              f"| full model (share=all) | {per_round['full']:,} "
              f"| {per_round['full'] / max(per_round['lora'], 1):.1f}x |",
              "", "wall time (s): " + ", ".join(f"{n} {s['wall_time_s']:.0f}" for n, s in
                                               (("federated", fed), ("federated, local heads", fedper),
                                                ("local", local), ("centralized", central)))]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
