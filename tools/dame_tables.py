"""Rerun the DAMe comparison and write Markdown tables shaped like the paper's Tables 2 and 3 + ablation.

    python tools/dame_tables.py --config configs/dame_crisis.yaml --out runs/dame_tables \
        [--seeds 0 1 2] [--methods dame local fedavg ...] [--attacks model data] [--set task.lr=0.001 ...]

Every run is a real federation (`hpcfed run CONFIG --np K method=M seed=S`); a run whose
``summary.json`` already exists is reused, so the script can be stopped and restarted. Table 2, twice:
in the paper's layout (one "NMI / AMI / ARI" cell per site, means over seeds, the average and the gain
over Local) and with mean ± std for every number; between them DAMe minus Local and minus FedAvg on
each site (the issue's "beats both on every site"). Table 3: DAMe and FedAvg with a fourth, malicious
client (``attack=model|data``), NMI on the honest sites next to the clean runs. Ablation: DAMe without
BOLA, SEGA or GLECC. Then the wall time of each run (``wall_time_s`` in ``summary.json``). Writes
``OUT/tables.md`` and prints it.

``--sweep KEY=V1,V2,...`` instead runs every method at each value of one config key, e.g. the data-size
sweep ``--sweep task.max_messages_per_site=200,500,1000 --methods local fedavg dame``: runs go to
``OUT/<last part of KEY>=V/METHOD/seedS`` with the override ``KEY=V`` added, no attacks are run, and the
tables are level × method × site NMI/AMI (mean ± sample sd over seeds), each site's test size and event
count, and each other method (DAMe first) minus Local and minus FedAvg, paired by seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MAIN_METHODS = ["local", "fedavg", "fedprox", "ditto", "dame"]
ABLATIONS = ["dame-no-bola", "dame-no-sega", "dame-no-glecc", "dame"]
METRICS = ("nmi", "ami", "ari")


def run_one(config: str, out: Path, np_: int, overrides: list[str], timeout: float) -> dict | None:
    """The run's summary.json, running the federation first if it has none; None if the run failed."""
    summary = out / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text())
    out.mkdir(parents=True, exist_ok=True)
    # --force: only runs without a summary get here; redo what a failed attempt left
    cmd = [sys.executable, "-m", "hpcfed", "run", config, "--np", str(np_), "--out", str(out), "--force", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    print("$", " ".join(cmd), flush=True)
    with open(out / "run.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not summary.is_file():
        print(f"  failed (exit {proc.returncode}); see {out / 'run.log'}", flush=True)
        return None
    return json.loads(summary.read_text())


def site_values(summary: dict, sites: list[int]) -> dict[int, dict[str, float]]:
    """Per site, its NMI / AMI / ARI from a run's summary."""
    return {s: {m: float(summary["clients"][str(s)][m]) for m in METRICS} for s in sites}


def fmt(values: list[float]) -> str:
    """mean ± std of `values` to 3 decimals (the value alone when there is one, – when none)."""
    if not values:
        return "–"
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def table_methods(results: dict[str, list[dict]], names: list[str], site_names: list[str], title: str) -> str:
    """Markdown table: methods × sites, each metric as mean ± std over seeds, and the gain over Local."""
    sites = list(range(len(site_names)))
    head = "| method | " + " | ".join(f"{n} {m.upper()}" for n in site_names for m in METRICS)
    head += " | avg NMI | avg AMI | avg ARI | gain NMI | gain AMI | gain ARI |"
    lines = [f"### {title}", "", head, "|" + "---|" * (2 + 3 * len(sites) + 5)]
    local_avg = None
    if results.get("local"):
        local_avg = {m: np.mean([np.mean([r[s][m] for s in sites]) for r in results["local"]]) for m in METRICS}
    for name in names:
        runs = results.get(name) or []
        if not runs:
            continue
        cells = [fmt([r[s][m] for r in runs]) for s in sites for m in METRICS]
        avg = {m: float(np.mean([np.mean([r[s][m] for s in sites]) for r in runs])) for m in METRICS}
        cells += [f"{avg[m]:.3f}" for m in METRICS]
        cells += [f"{avg[m] - local_avg[m]:+.3f}" if local_avg and name != "local" else "–" for m in METRICS]
        lines.append(f"| {name} (n={len(runs)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_paper(results: dict[str, list[dict]], names: list[str], site_names: list[str]) -> str:
    """The paper's Table 2 layout: one cell "NMI / AMI / ARI" (means over seeds) per site, then the average and
    the gain over Local."""
    sites = list(range(len(site_names)))

    def cell(values: dict[str, float]) -> str:
        return " / ".join(f"{values[m]:.3f}".lstrip("0") if values[m] >= 0 else f"{values[m]:.3f}" for m in METRICS)

    def mean(runs: list[dict], s: int | None, m: str) -> float:
        return float(np.mean([r[s][m] if s is not None else np.mean([r[i][m] for i in sites]) for r in runs]))

    head = "| method | " + " | ".join(site_names) + " | avg | gain over Local |"
    lines = ["### Table 2 (paper layout): NMI / AMI / ARI, mean over seeds", "", head, "|" + "---|" * (len(sites) + 3)]
    local = results.get("local")
    for name in names:
        runs = results.get(name) or []
        if not runs:
            continue
        cells = [cell({m: mean(runs, s, m) for m in METRICS}) for s in sites]
        cells.append(cell({m: mean(runs, None, m) for m in METRICS}))
        gain = "–" if not local or name == "local" else " / ".join(
            f"{mean(runs, None, m) - mean(local, None, m):+.3f}" for m in METRICS)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {gain} |")
    return "\n".join(lines)


def table_per_site_gain(results: dict[str, list[dict]], site_names: list[str], method: str = "dame") -> str:
    """NMI of `method` minus Local and minus FedAvg on each site (the issue's "beats both on every site")."""
    sites = list(range(len(site_names)))
    runs = results.get(method)
    if not runs:
        return ""
    lines = [f"### {method} minus each baseline, NMI per site (mean over seeds)", "",
             "| baseline | " + " | ".join(site_names) + " | avg | sites won |", "|" + "---|" * (len(sites) + 3)]
    for base in ("local", "fedavg"):
        other = results.get(base)
        if not other:
            continue
        d = [float(np.mean([r[s]["nmi"] for r in runs]) - np.mean([r[s]["nmi"] for r in other])) for s in sites]
        lines.append(f"| {base} | " + " | ".join(f"{v:+.3f}" for v in d) + f" | {np.mean(d):+.3f} | "
                     f"{sum(v > 0 for v in d)} of {len(d)} |")
    return "\n".join(lines)


def _sd(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _msd(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {_sd(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def sweep(args: argparse.Namespace) -> int:
    """Every method at each value of one config key (``--sweep KEY=V1,V2``); tables per level."""
    key, _, values = args.sweep.partition("=")
    levels = [v.strip() for v in values.split(",") if v.strip()]
    if not key or not levels:
        raise SystemExit("--sweep wants KEY=V1,V2,... (e.g. task.max_messages_per_site=200,500,1000)")
    short = key.split(".")[-1]
    out = Path(args.out)
    k = len(args.sites)
    sites = list(range(k))
    # runs[level][method][seed] = summary
    runs: dict[str, dict[str, dict[int, dict]]] = {}
    for level in levels:
        for seed in args.seeds:
            for method in args.methods:
                d = out / f"{short}={level}" / method / f"seed{seed}"
                if args.tables_only:
                    s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else None
                else:
                    s = run_one(args.config, d, k + 1,
                                [f"method={method}", f"seed={seed}", *args.set, f"{key}={level}"], args.timeout)
                if s:
                    runs.setdefault(level, {}).setdefault(method, {})[seed] = s

    def val(s: dict, site: int | None, m: str) -> float:
        c = s["clients"]
        return float(c[str(site)][m]) if site is not None else float(np.mean([float(c[str(i)][m]) for i in sites]))

    names = [*args.sites, "avg"]
    idx: list[int | None] = [*sites, None]
    parts = [f"Sweep of `{key}` over {levels}: `{args.config}` {' '.join(args.set)}; methods {args.methods}; "
             f"seeds {args.seeds}. Metrics on each site's test split (k-means, k = number of events); "
             "mean ± sample sd (ddof = 1) over seeds.", ""]

    # test split per site and level (from summary.json: the same for every method and seed, else flagged)
    parts += ["### Test split per site: messages / events", "",
              f"| {short} | " + " | ".join(args.sites) + " |", "|" + "---|" * (k + 1)]
    for level in levels:
        cells = []
        for s in sites:
            seen = {(int(r["clients"][str(s)].get("num_test", -1)), int(r["clients"][str(s)].get("num_events", -1)))
                    for by_seed in runs.get(level, {}).values() for r in by_seed.values()}
            cells.append(" or ".join(f"{n} / {e}" for n, e in sorted(seen)) + (" (differs!)" if len(seen) > 1 else "")
                         if seen else "–")
        parts.append(f"| {level} | " + " | ".join(cells) + " |")

    # level × method × site
    for metric in ("nmi", "ami"):
        M = metric.upper()
        parts += ["", f"### {M} per level, method and site (mean ± sd over seeds)", "",
                  f"| {short} | method | " + " | ".join(names) + f" | {M} gain over Local |", "|" + "---|" * (k + 4)]
        for level in levels:
            local = runs.get(level, {}).get("local")
            for method in args.methods:
                by_seed = runs.get(level, {}).get(method)
                if not by_seed:
                    continue
                cells = [_msd([val(r, s, metric) for r in by_seed.values()]) for s in idx]
                gain = "–"
                if local and method != "local":
                    diff = (np.mean([val(r, None, metric) for r in by_seed.values()])
                            - np.mean([val(r, None, metric) for r in local.values()]))
                    gain = f"{diff:+.3f}"
                parts.append(f"| {level} | {method} (n={len(by_seed)}) | " + " | ".join(cells) + f" | {gain} |")

    # each method (DAMe first) minus each baseline, paired by seed
    targets = sorted((m for m in args.methods if m not in ("local", "fedavg")), key=lambda m: m != "dame")
    for target, metric in ((t, m) for t in targets for m in ("nmi", "ami")):
        M = metric.upper()
        parts += ["", f"### {target} minus each baseline, {M}, paired by seed: "
                      "mean ± sd (seeds with a positive difference)",
                  "", f"| {short} | baseline | " + " | ".join(names) + " | per-seed avg | sites won |",
                  "|" + "---|" * (k + 5)]
        for level in levels:
            mine = runs.get(level, {}).get(target)
            for base in ("local", "fedavg"):
                other = runs.get(level, {}).get(base)
                if not mine or not other:
                    continue
                common = sorted(set(mine) & set(other))
                if not common:
                    continue
                cells, won = [], 0
                for s in idx:
                    d = [val(mine[x], s, metric) - val(other[x], s, metric) for x in common]
                    cells.append(f"{np.mean(d):+.3f} ± {_sd(d):.3f} ({sum(v > 0 for v in d)}/{len(d)})")
                    if s is not None and np.mean(d) > 0:
                        won += 1
                per_seed = ", ".join(f"{val(mine[x], None, metric) - val(other[x], None, metric):+.3f}" for x in common)
                parts.append(f"| {level} | {base} | " + " | ".join(cells) + f" | {per_seed} | {won} of {k} |")

    parts += ["", "### Wall time per run (s, mean ± sd over seeds; the machine was shared)", "",
              f"| {short} | " + " | ".join(args.methods) + " |", "|" + "---|" * (len(args.methods) + 1)]
    for level in levels:
        cells = []
        for method in args.methods:
            w = [float(r.get("wall_time_s", float("nan"))) for r in runs.get(level, {}).get(method, {}).values()]
            cells.append(f"{np.mean(w):.0f} ± {_sd(w):.0f}" if w else "–")
        parts.append(f"| {level} | " + " | ".join(cells) + " |")
    text = "\n".join(parts) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run (or reuse) every federation the tables need and write OUT/tables.md; exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/dame_crisis.yaml")
    p.add_argument("--out", default="runs/dame_tables")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=MAIN_METHODS + ABLATIONS[:-1])
    p.add_argument("--attacks", nargs="*", default=["model", "data"])
    p.add_argument("--attack-methods", nargs="+", default=["dame", "fedavg"])
    p.add_argument("--sites", nargs="+", default=["CrisisLexT26", "CrisisLexT6", "Arabic"],
                   help="display names of the honest sites, in client order")
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--tables-only", action="store_true", help="only read finished runs and write the tables")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", help="run --methods at each value of one config key "
                   "(e.g. task.max_messages_per_site=200,500,1000) and write the sweep tables; no attacks")
    args = p.parse_args(argv)
    if args.sweep:
        return sweep(args)

    out = Path(args.out)
    k = len(args.sites)
    sites = list(range(k))
    clean: dict[str, list[dict]] = {}
    attacked: dict[tuple[str, str], list[dict]] = {}
    walls: dict[str, list[float]] = {}  # run name -> wall_time_s of each seed (summary.json)
    for seed in args.seeds:
        for method in dict.fromkeys(args.methods + (args.attack_methods if args.attacks else [])):
            d = out / method / f"seed{seed}"
            s = (json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else None) \
                if args.tables_only else run_one(args.config, d, k + 1, [f"method={method}", f"seed={seed}", *args.set],
                                                 args.timeout)
            if s:
                clean.setdefault(method, []).append(site_values(s, sites))
                walls.setdefault(method, []).append(float(s.get("wall_time_s", float("nan"))))
        for attack in args.attacks:
            for method in args.attack_methods:
                d = out / f"{method}-attack-{attack}" / f"seed{seed}"
                s = (json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else None) \
                    if args.tables_only else run_one(
                        args.config, d, k + 2, [f"method={method}", f"seed={seed}", f"attack={attack}", *args.set],
                        args.timeout)
                if s:
                    attacked.setdefault((method, attack), []).append(site_values(s, sites))
                    walls.setdefault(f"{method} attack={attack}", []).append(float(s.get("wall_time_s", float("nan"))))

    parts = [f"Settings: `{args.config}` {' '.join(args.set)}; seeds {args.seeds}; metrics on each site's test split "
             "(k-means, k = number of events), mean ± std over seeds.", ""]
    parts.append(table_paper(clean, MAIN_METHODS, args.sites))
    parts.append("")
    parts.append(table_per_site_gain(clean, args.sites))
    parts.append("")
    parts.append(table_methods(clean, MAIN_METHODS, args.sites,
                               "Table 2 (shape): methods × sites, mean ± std over seeds"))
    parts.append("")
    parts.append(table_methods(clean, ["local", *ABLATIONS], args.sites, "Ablation: DAMe without one component"))
    if attacked:
        parts += ["", "### Table 3 (shape): injection attacks, NMI on the honest sites", "",
                  "| method | site | clean | model poisoning | data poisoning |", "|---|---|---|---|---|"]
        def col(runs: list[dict] | None, site: int | None) -> str:
            if not runs:
                return "–"
            vals = [r[site]["nmi"] if site is not None else np.mean([r[i]["nmi"] for i in sites]) for r in runs]
            return fmt(vals)

        for method in args.attack_methods:
            rows: list[tuple[str, int | None]] = [(name, s) for s, name in enumerate(args.sites)]
            rows.append(("average", None))
            for name, s in rows:
                lines = [col(clean.get(method), s), col(attacked.get((method, "model")), s),
                         col(attacked.get((method, "data")), s)]
                parts.append(f"| {method} | {name} | " + " | ".join(lines) + " |")
        parts += ["", "| method | Δ mean NMI, model poisoning | Δ mean NMI, data poisoning |", "|---|---|---|"]
        for method in args.attack_methods:
            base = clean.get(method)
            cells = []
            for attack in ("model", "data"):
                runs = attacked.get((method, attack))
                if base and runs:
                    b = np.mean([np.mean([r[i]["nmi"] for i in sites]) for r in base])
                    a = np.mean([np.mean([r[i]["nmi"] for i in sites]) for r in runs])
                    cells.append(f"{a - b:+.3f}")
                else:
                    cells.append("–")
            parts.append(f"| {method} | " + " | ".join(cells) + " |")
    if walls:
        parts += ["", "### Wall time per run (s, mean ± std over seeds; the machine was shared)", "",
                  "| run | wall time |", "|---|---|"]
        parts += [f"| {name} | {np.mean(vals):.0f} ± {np.std(vals):.0f} |" for name, vals in walls.items()]
    text = "\n".join(parts) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
