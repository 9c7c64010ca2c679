"""DP-SGD's step (Abadi et al. 2016) for any torch model: Poisson-sampled batches, per-example
gradients, each clipped to L2 norm C, summed, Gaussian noise of std z·C added, divided by the expected
batch q·n. The optimizer (SGD, Adam, ...) then steps on that gradient as on any other: what it does
with it is post-processing.

A model whose trainable parameters all sit in linear layers (the quickstart's MLP, LoRA adapters and
a linear head) needs no per-example gradients: `hpcfed.privacy.linear_clip` forms the clipped sum from
the layers' activations in one forward and one backward pass. For other models, per-example gradients
come from Opacus's `GradSampleModule` hooks: one forward and one backward pass
of the batch, each supported layer's (Linear, Embedding, LayerNorm, convolutions, ...) per-example
gradient formed from its saved activations and output gradients, and Opacus's per-layer `torch.func`
for the others. That costs a fraction of vmapping the whole model (measured in tools/bench_privacy.py
--record-dp), and it runs Hugging Face's encoders, whose attention-mask code cannot be vmapped; only
the parameters with ``requires_grad`` get per-example gradients (a frozen encoder with LoRA adapters
pays for the adapters). A trainable parameter the hooks do not see (used outside a module's forward)
switches the site to `torch.func` over the whole model (vmap of grad); a model that cannot be vmapped
either, to one backward pass per example (the same gradients, slower). A model whose forward mixes the
examples of a batch (BatchNorm in training mode) must not come here: one record would move the
others' gradients (`TorchTask` refuses it).

The batches and the noise come from one generator seeded from the site's secret seed (derived from
the job's key, `hpcfed.credentials.RankKeys.secret_seed`, all 256 bits) and the round: a resumed site draws what its
uninterrupted twin drew, and no reader of the run's outputs (where the config seed is written) can
regenerate the noise, nor tell which records a step sampled (the sampling amplification needs that).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hpcfed.privacy.linear_clip import LinearClip
from hpcfed.privacy.record_dp import Plan

log = logging.getLogger("hpcfed.client")


def round_generator(secret_seed: int, client_id: int, round: int) -> np.random.Generator:
    """The Generator of one site's round (batches and noise), seeded by the whole 256-bit secret seed
    with the site and round, as DP-FedAvg's noise is (`hpcfed.privacy.dp.noise_rng`): a torch
    Generator takes a 64-bit seed, which would fold the secret to a quarter of its bits."""
    if secret_seed < 0 or client_id < 0 or round < 0:
        raise ValueError(f"seed, client and round must be >= 0, got {secret_seed}, {client_id}, {round}")
    return np.random.default_rng([secret_seed, client_id, round, 0xD95])


def poisson_batch(records: int, sample_rate: float, generator: np.random.Generator) -> Any:
    """Indices of one Poisson-sampled batch (a torch tensor): each record in it with probability
    `sample_rate`."""
    import torch

    return torch.from_numpy(np.flatnonzero(generator.random(records) < sample_rate))


def _example(value: Any, i: int) -> Any:
    """Example `i` of a batch's tensors (dicts/lists/tuples of them), as a batch of one."""
    if hasattr(value, "unsqueeze"):
        return value[i:i + 1]
    if isinstance(value, dict):
        return {k: _example(v, i) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_example(v, i) for v in value)
    return value


def _unsqueeze(value: Any) -> Any:
    """One example's tensors (dicts/lists/tuples of them) as a batch of one."""
    if hasattr(value, "unsqueeze"):
        return value.unsqueeze(0)
    if isinstance(value, dict):
        return {k: _unsqueeze(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unsqueeze(v) for v in value)
    return value


class _LossOf:
    """Builds the module `functional_call` reparametrises: it owns the model, so "model.<name>" swaps
    the model's own parameters while the task's loss(inputs, target) runs the model as it always does."""

    @staticmethod
    def build(model: Any, loss: Callable[[Any, Any], Any]) -> Any:
        from torch import nn

        class _Wrapper(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, inputs: Any, target: Any) -> Any:
                return loss(inputs, target)

        return _Wrapper()


class DPSGD:
    """One site's DP-SGD steps on `model`; `loss(inputs, target)` is the task's mean loss of a batch."""

    def __init__(self, model: Any, loss: Callable[[Any, Any], Any], plan: Plan) -> None:
        self.plan = plan
        self.model = model
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._loss = loss
        self._wrapper = _LossOf.build(model, loss)
        self._gsm: Any = None  # Opacus's GradSampleModule while `hooked`
        import opacus  # noqa: F401  (imported at setup: its first import takes seconds, not a round's time)
        self._linear = LinearClip.for_model(model, self.params)
        # "linear": clipped sums without per-example gradients (`hpcfed.privacy.linear_clip`), for models
        # whose trainable parameters are all linear layers'; else (or when a forward does not fit it)
        # "hooks", then "vmap" when the hooks miss a parameter, "loop" when vmap fails too
        self.method = "linear" if self._linear is not None else "hooks"

    @property
    def looped(self) -> bool:
        """Whether this model takes one backward pass per example (neither hooks nor vmap cover it)."""
        return self.method == "loop"

    def per_example_grads(self, inputs: Any, target: Any) -> list[Any]:
        """Each trainable parameter's gradient, per example (a leading batch dimension)."""
        if self.method == "linear":  # forms clipped sums, not per-example gradients: those come from the hooks
            self._leave_linear()
        if self.method == "hooks":
            grads = self._hooked(inputs, target)
            if grads is not None:
                return grads
            self._unhook()  # functional_call must not run through them
            self.method = "vmap"
        if self.method == "vmap":
            try:
                return self._vmapped(inputs, target)
            except RuntimeError as exc:
                if "vmap" not in str(exc):
                    raise
                log.info("per-example gradients: the model cannot be vmapped (%s); one backward pass per example",
                         str(exc).split(".")[0][:120])
                self.method = "loop"
        return self._looped(inputs, target)

    @contextmanager
    def hooked(self) -> Iterator[None]:
        """Opacus's hooks on the model for a round's steps, removed after them: between rounds (and in
        evaluation) the model is as the task built it."""
        from opacus import GradSampleModule

        if self.method == "linear" and self._linear is not None:
            self._linear.attach()
        if self.method == "hooks":
            # strict=False: buffers (a transformer's position ids) are no record's data; BatchNorm, which
            # would be, is refused before a model gets here (`refuse_record_mixing`)
            self._gsm = GradSampleModule(self.model, batch_first=True, loss_reduction="mean", strict=False)
        try:
            yield
        finally:
            self._unhook()

    def _leave_linear(self) -> None:
        """Take Opacus's hooks from now on (for the rest of the round too, when inside `hooked`)."""
        inside = self._linear is not None and self._linear.attached
        if self._linear is not None:
            self._linear.detach()
        self.method = "hooks"
        if inside:
            from opacus import GradSampleModule

            self._gsm = GradSampleModule(self.model, batch_first=True, loss_reduction="mean", strict=False)

    def _unhook(self) -> None:
        if self._linear is not None:
            self._linear.detach()
        if self._gsm is not None:
            self._gsm.cleanup()  # the hooks and Opacus's attributes (grad_sample) off the parameters
            self._gsm = None

    def _hooked(self, inputs: Any, target: Any) -> list[Any] | None:
        """Per-example gradients from Opacus's hooks; None when they missed a trainable parameter."""
        if self._gsm is None:
            with self.hooked():
                return self._hooked(inputs, target)
        with warnings.catch_warnings():  # the first layer's inputs (the data) need no gradient: as meant
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            self._loss(inputs, target).backward()
        grads = self._samples(int(target.shape[0]))
        for p in self.params:  # as GradSampleModule.zero_grad does, without walking the whole model each step
            p.grad_sample = None
        return grads

    def _samples(self, batch: int) -> list[Any] | None:
        """The `grad_sample` the hooks left on each trainable parameter; None if one has none or a wrong shape."""
        grads = []
        for name, p in zip(self.names, self.params, strict=True):
            sample = getattr(p, "grad_sample", None)
            if sample is None and p.grad is None:  # not used by this loss: no gradient, from any example
                sample = p.detach().new_zeros((batch, *p.shape))
            elif sample is None or tuple(sample.shape) != (batch, *p.shape):
                log.info("per-example gradients: Opacus's hooks do not cover %s (%s); torch.func over the model",
                         name, "unseen" if sample is None else f"shape {tuple(sample.shape)}")
                return None
            grads.append(sample)
        return grads

    def _looped(self, inputs: Any, target: Any) -> list[Any]:
        import torch

        params = self.params
        per_param: list[list[Any]] = [[] for _ in params]
        for i in range(int(target.shape[0])):
            loss = self._loss(_example(inputs, i), _example(target, i))
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for into, g, p in zip(per_param, grads, params, strict=True):
                into.append(g if g is not None else torch.zeros_like(p))
        return [torch.stack(gs) for gs in per_param]

    def _vmapped(self, inputs: Any, target: Any) -> list[Any]:
        from torch.func import functional_call, grad, vmap

        params = {f"model.{n}": p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

        def one(p: dict[str, Any], x: Any, y: Any) -> Any:
            return functional_call(self._wrapper, p, (_unsqueeze(x), _unsqueeze(y)), strict=False)

        grads = vmap(grad(one), in_dims=(None, 0, 0), randomness="different")(params, inputs, target)
        return [grads[f"model.{n}"] for n in self.names]

    def clipped_sum(self, grads: list[Any]) -> list[Any]:
        """Σ_i g_i · min(1, C / ‖g_i‖): one example adds at most C to the sum, whatever its gradient."""
        import torch

        norms = torch.sqrt(sum(g.flatten(1).float().pow(2).sum(1) for g in grads))
        factor = torch.clamp(self.plan.clip_norm / (norms + 1e-6), max=1.0)
        return [torch.tensordot(factor.to(g.dtype), g, dims=1) for g in grads]

    def set_noisy_grad(self, inputs: Any, target: Any, batch: int, generator: np.random.Generator,
                       reduce: Callable[[list[Any]], list[Any]] | None = None) -> None:
        """Set each trainable parameter's .grad to (clipped sum + N(0, (zC)²)) / (q·n) for a batch of
        `batch` examples (0: the noise alone, as the accountant counts an empty batch too). On a site
        of many ranks `reduce` sums the clipped sums of the ranks' shards of the batch, and the noise
        is added once, after it: every rank draws the same noise from the site's generator."""
        import torch

        params = self.params
        sums: list[Any] | None = None
        if batch and self.method == "linear" and self._linear is not None:
            if not self._linear.attached:  # called outside `hooked` (a test): for this step
                with self.hooked():
                    return self.set_noisy_grad(inputs, target, batch, generator, reduce)
            sums = self._linear.clipped_sum(lambda: self._loss(inputs, target), batch, self.plan.clip_norm)
            if sums is None:
                log.info("per-example clipping: this model's forward does not fit the linear layers' clipped sums; "
                         "Opacus's hooks")
                self._leave_linear()
        if sums is None:
            sums = (self.clipped_sum(self.per_example_grads(inputs, target)) if batch
                    else [torch.zeros_like(p) for p in params])
        if reduce is not None:  # the site's ranks' clipped sums, summed before the one noise draw
            sums = reduce(sums)
        # the noise of every parameter in one draw (one call, not one per tensor), then cut to their shapes
        sizes = [p.numel() for p in params]
        noise = torch.from_numpy(generator.normal(0.0, self.plan.noise_multiplier * self.plan.clip_norm,
                                                  size=sum(sizes)))
        for p, s, n in zip(params, sums, noise.split(sizes), strict=True):
            p.grad = (s.to(p.dtype) + n.view(p.shape).to(p.device, p.dtype)).div_(self.plan.expected_batch)
