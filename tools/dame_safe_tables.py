"""Safe DAMe against the paper's DAMe, Local and FedAvg on one split (issue 26): per-site tables, the
issue's goals, and per-round figures of what GLECC, BOLA and the validation NMI did.

    python tools/dame_safe_tables.py --config configs/dame_types.yaml --out runs/dame_types \
        --sites Earthquakes Floods Typhoons+fires [--shared 0 1] [--seeds 0 1 2] [--figure docs/img/x.png]

Runs (or reuses: a run with a ``summary.json`` is read, not rerun) ``method=local|fedavg|dame|dame-paper``
for every seed under ``OUT/METHOD/seedS`` with `dame_tables.run_one`, then writes ``OUT/safe.md``
(``--shadow-local``: Local's figures from the safe DAMe run's shadow Local model, which is
``method=local``'s model bit for bit, instead of a run of its own; a finished ``method=local`` run is
read and the largest difference printed):

- NMI per site (mean ± sample sd over seeds) of every method, and DAMe and DAMe-paper minus Local and
  minus FedAvg paired by seed (mean, worst seed);
- the goals: DAMe ≥ Local − 0.01 on every site and every seed (the worst site-seed named, then a row per
  site-seed: delivered and Local test NMI, their difference, what was kept, the best other candidate's
  validation edge and bootstrap bound); DAMe ahead of FedAvg; DAMe above Local on the sites named by
  ``--shared`` (the sites whose events other sites also hold), mean over seeds and in how many site-seeds;
- what the safe DAMe kept per site (personalised or Local, over seeds) and its ``vs_local_nmi`` (the
  delivered model minus Local);
- per site and method, the mean over seeds and rounds of GLECC's weight α (``train_alpha``), GLECC's loss,
  BOLA's λ (rounds ≥ 1), the share of rounds GLECC ran (safe DAMe's gate) and the last round's validation NMI.

``--figure`` draws, per site, the validation NMI per round of each method, GLECC's α and loss per round
(DAMe-paper), and BOLA's λ per round (both DAMe), means over seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dame_tables import run_one

METHODS = ["local", "fedavg", "dame-paper", "dame"]


def _sd(v: list[float]) -> float:
    return float(np.std(v, ddof=1)) if len(v) > 1 else 0.0


def per_round(run_dir: Path, name: str) -> dict[int, dict[int, float]]:
    """metrics.jsonl of a run: {client: {round: value}} of metric `name`."""
    out: dict[int, dict[int, float]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in filter(str.strip, path.read_text().splitlines()):
        e = json.loads(line)
        if e.get("name") == name and e.get("client") is not None:
            out.setdefault(int(e["client"]), {})[int(e["round"])] = float(e["value"])
    return out


def shadow_local(dame: dict, k: int) -> dict | None:
    """A Local summary from a safe DAMe run's shadow Local model (``clients.K.local_nmi``, which is
    ``method=local``'s model bit for bit); None if a site lacks it."""
    try:
        return {"clients": {str(c): {"nmi": float(dame["clients"][str(c)]["local_nmi"])} for c in range(k)},
                "shadow": True}
    except (KeyError, TypeError, ValueError):
        return None


def collect(args: argparse.Namespace) -> dict[str, dict[int, dict]]:
    """summaries[method][seed], running what is missing unless --tables-only. With --shadow-local,
    Local's figures of a seed come from the safe DAMe run's shadow Local model (method=local is not run;
    a finished method=local run is read and checked against it)."""
    runs: dict[str, dict[int, dict]] = {}
    k = len(args.sites)
    for seed in args.seeds:
        for method in args.methods:
            d = Path(args.out) / method / f"seed{seed}"
            if args.tables_only or (args.shadow_local and method == "local"):
                s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else None
            else:
                s = run_one(args.config, d, len(args.sites) + 1, [f"method={method}", f"seed={seed}", *args.set],
                            args.timeout)
            if s:
                runs.setdefault(method, {})[seed] = s
        dame = runs.get("dame", {}).get(seed)
        if args.shadow_local and "local" in args.methods and dame and (shadow := shadow_local(dame, k)):
            ran = runs.setdefault("local", {}).get(seed)
            if ran:
                gap = max(abs(float(ran["clients"][str(c)]["nmi"]) - shadow["clients"][str(c)]["nmi"])
                          for c in range(k))
                args.shadow_checks.append((seed, gap))
            else:
                runs["local"][seed] = shadow
    return runs


def kept_name(site: dict) -> str:
    """What a safe DAMe site delivered, from its summary: ``cluster``, ``personalised`` or ``Local``."""
    if float(site.get("kept_cluster", 0)):
        return "cluster"
    return "personalised" if float(site.get("kept_personal", 0)) else "Local"


def site_seed_table(args: argparse.Namespace, runs: dict[str, dict[int, dict]]) -> list[str]:
    """Markdown lines: per seed and site, the safe DAMe's delivered test NMI, Local's, their difference,
    what it kept, and the best other candidate's validation edge over Local and bootstrap bound (a bound
    only where that candidate had an edge)."""
    lines = ["", "  Every site-seed (delivered = the safe DAMe's model; edge and bound: the best other candidate "
             "on validation):", "", "  | seed | site | delivered | Local | delivered − Local | kept | val edge | "
             "bound |", "  |" + "---|" * 8]
    for seed in sorted(set(runs["dame"]) & set(runs["local"])):
        for c, name in enumerate(args.sites):
            site, local = runs["dame"][seed]["clients"][str(c)], float(runs["local"][seed]["clients"][str(c)]["nmi"])
            val = [float(site[f"val_{n}_nmi"]) for n in ("personal", "cluster") if f"val_{n}_nmi" in site]
            edge = f"{max(val) - float(site['val_local_nmi']):+.4f}" if val and "val_local_nmi" in site else "–"
            bound = f"{float(site['val_gain_lower']):+.4f}" if "val_gain_lower" in site else "–"
            lines.append(f"  | {seed} | {name} | {float(site['nmi']):.4f} | {local:.4f} | "
                         f"{float(site['nmi']) - local:+.4f} | {kept_name(site)} | {edge} | {bound} |")
    return lines


def tables(args: argparse.Namespace, runs: dict[str, dict[int, dict]]) -> str:
    """The Markdown of OUT/safe.md."""
    k = len(args.sites)
    nmi = {m: {seed: [float(s["clients"][str(c)]["nmi"]) for c in range(k)] for seed, s in by.items()}
           for m, by in runs.items()}
    parts = [f"Split `{args.config}` {' '.join(args.set)}; seeds {args.seeds}; test NMI per site "
             "(mean ± sample sd over seeds).", ""]
    shadow = sorted(seed for seed, s in runs.get("local", {}).items() if s.get("shadow"))
    if shadow:
        parts += [f"Local of seeds {shadow}: the safe DAMe run's shadow Local model (`local_nmi`, "
                  "method=local's model bit for bit), not a run of its own."]
        parts += [f"Checked against a method=local run, seed {seed}: largest difference over sites {gap:.6f}."
                  for seed, gap in getattr(args, "shadow_checks", [])]
        parts.append("")
    parts += ["| method | " + " | ".join(args.sites) + " | mean |", "|" + "---|" * (k + 2)]
    for m in args.methods:
        if m in nmi:
            cells = [f"{np.mean(col):.3f} ± {_sd(list(col)):.3f}" for col in zip(*nmi[m].values())]
            means = [float(np.mean(v)) for v in nmi[m].values()]
            parts.append(f"| {m} (n={len(nmi[m])}) | " + " | ".join(cells)
                         + f" | {np.mean(means):.3f} ± {_sd(means):.3f} |")
    parts += ["", "Paired by seed: mean difference (worst seed)", "",
              "| method − baseline | " + " | ".join(args.sites) + " | mean |", "|" + "---|" * (k + 2)]
    diffs: dict[tuple[str, str], list[list[float]]] = {}
    for m in ("dame", "dame-paper"):
        for base in ("local", "fedavg"):
            if m not in nmi or base not in nmi:
                continue
            common = sorted(set(nmi[m]) & set(nmi[base]))
            d = [[nmi[m][s][c] - nmi[base][s][c] for s in common] for c in range(k)]
            d.append([float(np.mean(nmi[m][s]) - np.mean(nmi[base][s])) for s in common])
            diffs[(m, base)] = d
            parts.append(f"| {m} − {base} | " + " | ".join(f"{np.mean(v):+.3f} ({min(v):+.3f})" for v in d) + " |")
    parts += ["", "Goals (issue 26), safe DAMe:", ""]
    if ("dame", "local") in diffs:
        seeds = sorted(set(nmi["dame"]) & set(nmi["local"]))
        cells = [(v, args.sites[c], seed) for c in range(k) for v, seed in zip(diffs[("dame", "local")][c], seeds)]
        worst, site, seed = min(cells)
        misses = sum(v < -0.01 for v, _, _ in cells)
        parts.append(f"- DAMe ≥ Local − 0.01 on every site and seed ({len(cells)} site-seeds): "
                     f"{'met' if misses == 0 else f'NOT met ({misses} below)'} "
                     f"(worst site-seed {worst:+.4f}: {site}, seed {seed})")
        parts += site_seed_table(args, runs)
    if ("dame", "fedavg") in diffs:
        lead = float(np.mean(diffs[("dame", "fedavg")][k]))
        parts.append(f"- DAMe ahead of FedAvg on the mean: {'met' if lead > 0 else 'NOT met'} ({lead:+.3f})")
    if args.shared and ("dame", "local") in diffs:
        gains = [float(np.mean(diffs[("dame", "local")][c])) for c in args.shared]
        above = [v > 0 for c in args.shared for v in diffs[("dame", "local")][c]]
        names = ", ".join(args.sites[c] for c in args.shared)
        parts.append(f"- DAMe above Local on the sites that share events ({names}), mean over seeds: "
                     f"{'met' if min(gains) > 0 else 'NOT met'} ({', '.join(f'{g:+.3f}' for g in gains)}; "
                     f"above in {sum(above)} of {len(above)} site-seeds)")
    if "dame" in runs:
        parts += ["", "What the safe DAMe kept per site (over seeds) and each candidate's test NMI minus the "
                  "site's own Local model (mean over seeds; the cluster model only where the site was not alone):", "",
                  "| | " + " | ".join(args.sites) + " |", "|" + "---|" * (k + 1)]
        by = list(runs["dame"].values())

        def count(key: str) -> list[int]:
            return [int(sum(float(s["clients"][str(c)].get(key, 0)) for s in by)) for c in range(k)]

        def mean_diff(key: str) -> list[float]:
            return [float(np.nanmean([float(s["clients"][str(c)].get(key, np.nan))
                                      - float(s["clients"][str(c)].get("local_nmi", np.nan)) for s in by]))
                    if any(key in s["clients"][str(c)] for s in by) else float("nan") for c in range(k)]

        kept, cluster = count("kept_personal"), count("kept_cluster")
        vs = [np.mean([float(s["clients"][str(c)].get("vs_local_nmi", np.nan)) for s in by]) for c in range(k)]
        parts.append("| kept a model other than Local | " + " | ".join(f"{x} of {len(by)}" for x in kept) + " |")
        parts.append("| of which the cluster model | " + " | ".join(f"{x}" for x in cluster) + " |")
        parts.append("| delivered model − Local (`vs_local_nmi`) | " + " | ".join(f"{v:+.3f}" for v in vs) + " |")
        for key, label in (("personal_nmi", "personalised − Local"), ("cluster_nmi", "cluster model − Local")):
            parts.append(f"| {label}, test | " + " | ".join(
                "–" if not np.isfinite(v) else f"{v:+.3f}" for v in mean_diff(key)) + " |")
    parts += ["", "Per round, mean over seeds and rounds ≥ 1 (GLECC α and loss, BOLA λ, share of rounds with "
              "GLECC on) and the last round's validation NMI:", "",
              "| method | site | GLECC α | GLECC loss | BOLA λ | GLECC on | last val NMI |", "|" + "---|" * 7]
    for m in args.methods:
        for c in range(k):
            cells = []
            for name in ("train_alpha", "train_glecc", "bola_lambda", "glecc_on", "val_nmi"):
                vals = []
                for seed in runs.get(m, {}):
                    series = per_round(Path(args.out) / m / f"seed{seed}", name).get(c, {})
                    rounds = [r for r in series if r >= 1]
                    if name == "val_nmi" and series:
                        vals.append(series[max(series)])
                    elif rounds and m.startswith("dame") and (name != "glecc_on" or m == "dame"):
                        vals.append(float(np.mean([series[r] for r in rounds])))
                cells.append(f"{np.mean(vals):.3f}" if vals else "–")
            parts.append(f"| {m} | {args.sites[c]} | " + " | ".join(cells) + " |")
    return "\n".join(parts) + "\n"


def figure(args: argparse.Namespace, runs: dict[str, dict[int, dict]], path: Path) -> None:
    """Per site: validation NMI per round (each method), GLECC α and loss (dame-paper), BOLA λ (both DAMe)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(args.sites)
    fig, axes = plt.subplots(k, 3, figsize=(13, 3.0 * k), squeeze=False)

    def mean_series(m: str, name: str, c: int) -> tuple[list[int], list[float]]:
        series = [per_round(Path(args.out) / m / f"seed{s}", name).get(c, {}) for s in runs.get(m, {})]
        rounds = sorted(set.intersection(*(set(x) for x in series))) if series and all(series) else []
        return rounds, [float(np.mean([x[r] for x in series])) for r in rounds]

    for c in range(k):
        ax = axes[c][0]
        for m in args.methods:
            ax.plot(*mean_series(m, "val_nmi", c), marker="o", ms=3, label=m)
        ax.set_title(f"{args.sites[c]}: validation NMI")
        ax = axes[c][1]
        ax.plot(*mean_series("dame-paper", "train_alpha", c), marker="o", ms=3, label="GLECC α (paper)")
        ax.plot(*mean_series("dame-paper", "train_glecc", c), marker="s", ms=3, label="GLECC loss (paper)")
        ax.plot(*mean_series("dame", "glecc_on", c), marker="^", ms=3, label="GLECC on (safe, share)")
        ax.set_title(f"{args.sites[c]}: GLECC")
        ax = axes[c][2]
        for m in ("dame-paper", "dame"):
            ax.plot(*mean_series(m, "bola_lambda", c), marker="o", ms=3, label=f"λ {m}")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{args.sites[c]}: BOLA λ (1 = local)")
        for ax in axes[c]:
            ax.set_xlabel("round")
            ax.legend(fontsize=7)
    fig.suptitle(f"{Path(args.config).name} {' '.join(args.set)}: means over seeds {args.seeds}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    """Run or reuse the split's federations, write OUT/safe.md (and the figure); exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sites", nargs="+", required=True, help="display names of the sites, in client order")
    p.add_argument("--shared", type=int, nargs="*", default=[], help="client ids of the sites that share events")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--tables-only", action="store_true", help="only read finished runs")
    p.add_argument("--shadow-local", action="store_true",
                   help="Local's figures from the safe DAMe run's shadow Local model (clients.K.local_nmi), "
                        "method=local's model bit for bit: no method=local run (one found is checked against it)")
    p.add_argument("--figure", type=Path, help="write the per-round figure here (PNG)")
    args = p.parse_args(argv)
    args.shadow_checks = []
    runs = collect(args)
    text = tables(args, runs)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "safe.md").write_text(text)
    print(text)
    if args.figure:
        figure(args, runs, args.figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
