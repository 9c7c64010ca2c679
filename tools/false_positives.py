"""Does bounded influence ever blame an honest site? The real `InfluenceGuard` over real local
training, in one process (no MPI: the matrix must fit a shared 2-core machine).

Each cell: K quickstart sites (`hpcfed.tasks.synthetic`, its MLP and Adam, one local epoch per
upload), every one honest, data split one of: label skew Dirichlet 0.1 / 0.5 / 1.0, quantity
skew (site 0 holds 10 x the examples, label skew 0.5), or a feature-shifted site (site 0's inputs
offset by +3 in every dimension, label skew 0.5). Sync: FedAvg rounds (weights and bounds from the
guard, as rank 0 applies them, `hpcfed.server.bounding`); async: FedAsync (alpha 0.6, polynomial
staleness a = 0.5), one site uploading at a time in a seeded random order, each upload measured
from the model that site was last sent, the guard's bounds fixed before each upload as rank 0 fixes
them (`hpcfed.server.async_loop`). ``--model torch`` uses the TorchTask a new user starts
from instead (`hpcfed new --template torch`: a 3-layer MLP over Gaussian blobs, batches of 32).
The same cell runs with the guard and without it:

    python tools/false_positives.py [--rounds 200] [--sites 3 8] [--modes sync async] [--model torch]
                                    [--seeds 0 1] [--own-clip 2 1000] [--json] [--out DIR]

Printed per cell: uploads refused, refusals that count as evidence (a site evicted past
security.max_refused_updates = 3 of them: the goal is none), clipped uploads, the largest
distance / max(typical, own) ratio seen (refused beyond influence.reject_factor = 10), and the
mean test accuracy with and without the guard (the goal: within 0.01); per site, its uploads
clipped, the share of its step a clip kept on average, and its accuracy with and without the guard;
and how many clips the cap on a site's own steps decided (`influence._OWN_CLIP`; `--own-clip`
runs the cell with other caps, each against the one run without the guard). The two arms of a
cell share the data, each site's training seed and the upload order, so a gap between them is the
guard's. ``--out DIR`` also writes each cell's row, with the CPU seconds of each arm, to DIR as the
cell finishes, so a long matrix that is stopped keeps what it measured. Nearly all of a cell's CPU
is the sites' local training (one upload of the quickstart or the template is 15-40 ms of CPU); the
guard, the copies in and out of the sites and the final evaluation are under a tenth of it.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from hpcfed.config import InfluenceConfig
from hpcfed.params import ParamLayout
from hpcfed.server import influence
from hpcfed.server.influence import InfluenceGuard, Refused
from hpcfed.tasks.base import Site, Task
from hpcfed.tasks.synthetic import SyntheticTask

SPLITS = ("dirichlet 0.1", "dirichlet 0.5", "dirichlet 1.0", "quantity 10x", "feature shift")
MAX_REFUSED = 3  # security.max_refused_updates' default
TORCH_TEMPLATE = Path(__file__).resolve().parents[1] / "hpcfed" / "templates" / "torch" / "task.py"


def make_sites(split: str, k: int, seed: int, out: Path, model: str = "quickstart") -> list[Task]:
    """K honest sites on `split`: the quickstart's, or the TorchTask of `hpcfed new --template torch`."""
    if model == "torch":
        return torch_sites(split, k, seed, out)
    base = SyntheticTask.Config()
    skew = float(split.split()[1]) if split.startswith("dirichlet") else 0.5
    sites = []
    for cid in range(k):
        cfg = replace(base, label_skew=skew,
                      samples_per_site=base.samples_per_site * (10 if split == "quantity 10x" and cid == 0 else 1))
        task = SyntheticTask(cfg, Site(client_id=cid, num_clients=k, seed=seed, out_dir=out))
        if split == "feature shift" and cid == 0:
            for key in ("x_train", "x_val", "x_test"):
                task.data[key] = task.data[key] + 3.0
        sites.append(task)
    return sites


def torch_sites(split: str, k: int, seed: int, out: Path) -> list[Task]:
    """K sites of the template a new user starts from (`hpcfed/templates/torch/task.py`: a
    TorchTask, a 3-layer MLP over Gaussian blobs, Adam, batches of 32), on `split` as above."""
    import torch
    from torch.utils.data import TensorDataset

    spec = importlib.util.spec_from_file_location("hpcfed_torch_template", TORCH_TEMPLATE)
    assert spec is not None and spec.loader is not None
    template = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(template)

    class ShiftedSite(template.SiteTask):  # type: ignore[name-defined,misc]  # the template's class, loaded above
        def dataset(self, part: str) -> TensorDataset:
            x, y = super().dataset(part).tensors
            return TensorDataset(x + (3.0 if self.site.client_id == 0 else 0.0), y)

    cls = ShiftedSite if split == "feature shift" else template.SiteTask
    skew = float(split.split()[1]) if split.startswith("dirichlet") else 0.5
    sites = []
    for cid in range(k):
        cfg = cls.Config(label_skew=skew, samples=400 * (10 if split == "quantity 10x" and cid == 0 else 1))
        cfg.validate()
        sites.append(cls(cfg, Site(client_id=cid, num_clients=k, seed=seed, out_dir=out)))
    torch.set_num_threads(1)
    return sites


def run_cell(split: str, k: int, mode: str, rounds: int, guarded: bool, seed: int = 0,
             model: str = "quickstart") -> dict:
    """One federation; its guard's record and the sites' final mean test accuracy."""
    with tempfile.TemporaryDirectory() as tmp:
        sites = make_sites(split, k, seed, Path(tmp), model)
        layout = ParamLayout.of(sites[0].get_parameters())
        model = layout.flatten(sites[0].get_parameters())
        guard = InfluenceGuard(InfluenceConfig(enabled=guarded), k)
        refused, evidence = 0, dict.fromkeys(range(k), 0)
        kept = {cid: [] for cid in range(k)}  # per site: ||clipped step|| / ||asked step|| of each clipped upload
        capped = 0  # clips where the site's own steps were beyond _OWN_CLIP x the typical one (the cap bound)

        def upload(cid: int, sent: np.ndarray, rnd: int) -> tuple[np.ndarray, int] | None:
            nonlocal refused
            sites[cid].set_parameters(layout.unflatten(sent))
            n = sites[cid].fit(rnd).num_examples
            flat = layout.flatten(sites[cid].get_parameters())
            if not guarded:
                return flat, n
            nonlocal capped
            weight = guard.weight(cid, n)
            typical, own, clipped = guard._typical, guard._own(cid), guard.clipped  # the bounds this upload meets
            try:
                asked = guard.bound(cid, flat, sent)
            except Refused as exc:
                refused += 1
                evidence[cid] += exc.evidence
                return None
            if guard.clipped > clipped:
                kept[cid].append(float(np.linalg.norm(flat - sent)) / asked)
                capped += bool(typical and own and own > influence._OWN_CLIP * typical)
            return flat, weight

        rng = np.random.default_rng(seed)
        sent = {cid: model.copy() for cid in range(k)}
        version = {cid: 0 for cid in range(k)}
        for rnd in range(rounds):
            if mode == "sync":
                guard.begin_round(set(range(k)))
                got = [u for u in (upload(cid, model, rnd) for cid in range(k)) if u is not None]
                guard.settle()
                if got:
                    weights = np.array([w for _, w in got], dtype=np.float64)
                    shares = (weights / weights.sum())[:, None]
                    model = (np.stack([f for f, _ in got]) * shares).sum(0).astype(np.float32)
                continue
            for step in range(k):  # async: k uploads per "round", each from a site picked at random
                cid = int(rng.integers(k))
                guard.begin_round(set(range(k)))  # as rank 0 does for each async upload (server/async_loop.py)
                got = upload(cid, sent[cid], rnd * k + step)
                guard.settle()
                if got is not None:
                    alpha = 0.6 * (rnd * k + step - version[cid] + 1) ** -0.5
                    model = ((1 - alpha) * model + alpha * got[0]).astype(np.float32)
                sent[cid], version[cid] = model.copy(), rnd * k + step + 1
        accuracy = []
        for task in sites:
            task.set_parameters(layout.unflatten(model))
            accuracy.append(task.evaluate(rounds, final=True)["accuracy"])
    return {"refused": refused, "evicted": sorted(c for c, n in evidence.items() if n > MAX_REFUSED),
            "evidence": sum(evidence.values()), "clipped": guard.clipped, "peak_ratio": round(guard.peak_ratio, 3),
            "accuracy": round(float(np.mean(accuracy)), 4), "site_accuracy": [round(a, 4) for a in accuracy],
            "capped": capped, "site_clipped": [len(kept[c]) for c in range(k)],
            "site_kept": [round(float(np.mean(kept[c])), 3) if kept[c] else 1.0 for c in range(k)]}


def main() -> None:
    """Run the matrix and print one line per cell (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--sites", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS)
    parser.add_argument("--model", choices=["quickstart", "torch"], default="quickstart",
                        help="the quickstart's sites, or the TorchTask template of `hpcfed new --template torch`")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="data, training and upload-order seeds")
    parser.add_argument("--own-clip", type=float, nargs="+", default=[influence._OWN_CLIP],
                        help="experiment: the cap on a site's own steps in its clip (influence._OWN_CLIP), "
                             "each against the same run without the guard")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, help="also write each cell's row to OUT/<cell>.json as it finishes")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # one core's worth: the machine is shared
    rows = []
    for mode in args.modes:
        for k in args.sites:
            for split, seed, own_clip in itertools.product(args.splits, args.seeds, args.own_clip):
                influence._OWN_CLIP = own_clip
                start = time.process_time()
                on = run_cell(split, k, mode, args.rounds, True, seed, model=args.model)
                cpu_on = time.process_time() - start
                if own_clip == args.own_clip[0]:  # the run without the guard does not depend on it
                    start = time.process_time()
                    off = run_cell(split, k, mode, args.rounds, False, seed, model=args.model)
                    cpu_off = time.process_time() - start
                rows.append({"model": args.model, "mode": mode, "sites": k, "split": split, "seed": seed,
                             "own_clip": own_clip, "rounds": args.rounds, **on,
                             "accuracy_off": off["accuracy"], "site_accuracy_off": off["site_accuracy"],
                             "cpu_s": [round(cpu_on, 1), round(cpu_off, 1)]})
                r = rows[-1]
                if args.out is not None:
                    args.out.mkdir(parents=True, exist_ok=True)
                    name = f"{args.model}_{mode}_K{k}_{split.replace(' ', '')}_r{args.rounds}_s{seed}_c{own_clip:g}"
                    (args.out / f"{name}.json").write_text(json.dumps(r, indent=2) + "\n")
                if not args.json:
                    print(f"{args.model:10} {mode:5} K={k:<2} {split:14} seed {seed} own clip {own_clip:g} "
                          f"refused {r['refused']:4} "
                          f"evidence {r['evidence']:3} "
                          f"evicted {r['evicted']} clipped {r['clipped']:5} peak ratio {r['peak_ratio']:6.3f} "
                          f"accuracy {r['accuracy']:.3f} off {r['accuracy_off']:.3f} "
                          f"({r['accuracy'] - r['accuracy_off']:+.3f}) capped {r['capped']} "
                          f"site clipped {r['site_clipped']} kept {r['site_kept']}", flush=True)
                    print(f"  site accuracy on  {r['site_accuracy']}\n  site accuracy off {r['site_accuracy_off']}",
                          flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
