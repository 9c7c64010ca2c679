"""A task's local training under ``privacy.record_dp``: the site's DP-SGD rounds and its accountant.

A task whose examples are independent records builds one `RecordDPTraining` when its `Site` carries
record-DP settings, and hands it each round's `fit`: the steps are Poisson-sampled DP-SGD steps
(`hpcfed.privacy.dp_sgd`), counted by the site's accountant (`hpcfed.privacy.record_dp`), whose state
rides in the task's `state_dict` so a resumed site continues it.

A site whose next round would take it past its target ε does not train: it says so once in its log,
reports ``record_dp_stopped`` = 1 and answers the round with the model it was sent and weight 0
(`num_examples` = 0), so FedAvg's weighted mean goes on with the others. Its training loss is not
reported under record DP: it is a statistic of the training records outside the accountant.

A site of many ranks (``federation.ranks_per_site``, `hpcfed.tasks.data_parallel`) runs the same
steps as one rank would: every rank draws the step's Poisson batch from the site's generator (the
same on each: the site's secret seed, the round) and takes its share of it; each clips its
examples' gradients and sums them, the sums are all-reduced over the site, and then the noise
N(0, (z·C)²) is added once to that sum of the whole batch: every rank draws the same noise, so
every rank holds the same noisy gradient, as R = 1 would (up to the all-reduce's order of
summation). The accountant counts the site's whole batch: q = batch_size / n, n the site's records.
"""


from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hpcfed.privacy.dp_sgd import DPSGD, poisson_batch, round_generator
from hpcfed.privacy.record_dp import SiteAccountant, SiteSettings, plan
from hpcfed.tasks import data_parallel
from hpcfed.tasks.base import Bundle, FitResult
from hpcfed.tasks.data_parallel import SiteRanks

log = logging.getLogger("hpcfed.client")

STATE_KEY = "record_dp"  # the accountant's state in the task's state_dict header


class RecordDPTraining:
    """One site's DP-SGD: `fit` runs a round's steps when the budget allows one more round."""

    def __init__(self, spec: SiteSettings, client_id: int, *, model: Any, loss: Callable[[Any, Any], Any],
                 records: int, batch_size: int, steps_per_round: int, ranks: SiteRanks | None = None) -> None:
        self.spec, self.client_id = spec, client_id
        self.ranks = ranks if data_parallel.parallel(ranks) else None  # a site of many ranks shares each batch
        self.plan = plan(spec.settings, client_id=client_id, records=records, batch_size=batch_size,
                         steps_per_round=steps_per_round, rounds=spec.rounds, where=spec.source)
        self.accountant = SiteAccountant(self.plan)
        self.sgd = DPSGD(model, loss, self.plan)
        self._said_stop = False

    def fit(self, round: int, optimizer: Any, gather: Callable[[Any], tuple[Any, Any]]) -> FitResult:
        """Run round `round`'s steps (`gather(indices)` gives a batch's inputs and targets), or stop."""
        if not self.accountant.can_take_round():
            return self._stopped(round)
        gen = round_generator(self.spec.secret_seed, self.client_id, round)
        with self.sgd.hooked():
            for _ in range(self.plan.steps_per_round):
                idx = poisson_batch(self.plan.records, self.plan.sample_rate, gen)  # the site's whole batch
                if self.ranks is not None:
                    idx = idx[self.ranks.shard(len(idx))]  # this rank's share of it
                inputs, target = gather(idx) if len(idx) else (None, None)
                optimizer.zero_grad(set_to_none=True)
                self.sgd.set_noisy_grad(inputs, target, len(idx), gen,
                                        self.ranks.sum_tensors if self.ranks is not None else None)
                optimizer.step()
        self.accountant.spend(self.plan.steps_per_round)
        return FitResult(num_examples=self.plan.records, metrics=self.metrics(stopped=False))

    def _stopped(self, round: int) -> FitResult:
        if not self._said_stop:
            self._said_stop = True
            log.warning("client %d: record-level DP budget reached (ε = %.3f of %.3g at δ = %.3g; one more round "
                        "would pass it): this site stops training from round %d and answers with the model it is "
                        "sent and weight 0", self.client_id, self.accountant.epsilon, self.plan.target_epsilon,
                        self.plan.delta, round)
        return FitResult(num_examples=0, metrics=self.metrics(stopped=True))

    def metrics(self, *, stopped: bool) -> dict[str, float]:
        """What the site reports each round: its ε so far, δ, and whether it has stopped."""
        return {"record_dp_epsilon": self.accountant.epsilon, "record_dp_delta": self.plan.delta,
                "record_dp_stopped": float(stopped)}

    def final_metrics(self) -> dict[str, float]:
        """The site's ε and δ at the end of the run, for its final RESULT (summary.json privacy.record_dp)."""
        return {"record_dp_epsilon": self.accountant.epsilon, "record_dp_delta": self.plan.delta}

    def save(self, state: Bundle) -> Bundle:
        """`state` (the task's own) with the accountant's added to its header."""
        header, arrays = state
        return {**header, STATE_KEY: self.accountant.state()}, arrays

    def load(self, state: Bundle) -> Bundle:
        """Continue the accountant from `state`; the task's own state without it."""
        header, arrays = state
        self.accountant.load(header.get(STATE_KEY))
        return {k: v for k, v in header.items() if k != STATE_KEY}, arrays


def steps_per_round(records: int, batch_size: int, epochs: int, max_steps: int | None = None) -> int:
    """Local steps in one round: `epochs` passes of ceil(n / batch) expected batches, capped by `max_steps`."""
    steps = epochs * -(-records // max(batch_size, 1))
    return min(steps, max_steps) if max_steps is not None else steps


def refuse_record_mixing(model: Any, shared: list[str], task: str) -> None:
    """Under record DP: no BatchNorm (it mixes the records of a batch, and its running statistics are
    computed from them outside DP-SGD), and no shared buffer (computed from the records, not noised)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    norms = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if norms:
        raise ValueError(f"task {task}: privacy.record_dp cannot bound one record through BatchNorm ({norms[0]}): it "
                         f"mixes the records of a batch; use GroupNorm or LayerNorm")
    params = {n for n, _ in model.named_parameters()}
    buffers = [n for n in shared if n not in params]
    if buffers:
        raise ValueError(f"task {task}: with privacy.record_dp only parameters may travel, and buffer {buffers[0]!r} "
                         f"is shared (share / share_patterns): it is computed from the records outside DP-SGD")
