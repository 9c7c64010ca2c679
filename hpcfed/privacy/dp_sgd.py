"""DP-SGD's step (Abadi et al. 2016) for any torch model: Poisson-sampled batches, per-example
gradients by `torch.func` (vmap of grad), each clipped to L2 norm C, summed, Gaussian noise of std
z·C added, divided by the expected batch q·n. The optimizer (SGD, Adam, ...) then steps on that
gradient as on any other: what it does with it is post-processing.

Per-example gradients come from `torch.func` rather than Opacus's GradSampleModule: it needs no
per-layer rule, so a user's model, a frozen encoder with LoRA adapters and the quickstart MLP all take
the same path; only the parameters with ``requires_grad`` get per-example gradients. A forward with
data-dependent control flow (Hugging Face's attention-mask shortcuts) cannot be vmapped: the first
such failure switches the site to one backward pass per example (the same gradients, slower). A
model whose forward mixes the examples of a batch (BatchNorm in training mode) must not come here:
one record would move the others' gradients (`TorchTask` refuses it).

The batches and the noise come from one generator seeded from the site's secret seed (derived from
the job's key, `hpcfed.credentials.RankKeys.secret_seed`, all 256 bits) and the round: a resumed site draws what its
uninterrupted twin drew, and no reader of the run's outputs (where the config seed is written) can
regenerate the noise, nor tell which records a step sampled (the sampling amplification needs that).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

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
        self._loss = loss
        self._wrapper = _LossOf.build(model, loss)
        self.looped = False  # vmap failed on this model: one backward pass per example

    def per_example_grads(self, inputs: Any, target: Any) -> list[Any]:
        """Each trainable parameter's gradient, per example (a leading batch dimension)."""
        if not self.looped:
            try:
                return self._vmapped(inputs, target)
            except RuntimeError as exc:
                if "vmap" not in str(exc):
                    raise
                log.info("per-example gradients: the model cannot be vmapped (%s); one backward pass per example",
                         str(exc).split(".")[0][:120])
                self.looped = True
        return self._looped(inputs, target)

    def _looped(self, inputs: Any, target: Any) -> list[Any]:
        import torch

        params = [p for p in self.model.parameters() if p.requires_grad]
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
        return [torch.einsum("i,i...->...", factor.to(g.dtype), g) for g in grads]

    def set_noisy_grad(self, inputs: Any, target: Any, batch: int, generator: np.random.Generator) -> None:
        """Set each trainable parameter's .grad to (clipped sum + N(0, (zC)²)) / (q·n) for a batch of
        `batch` examples (0: the noise alone, as the accountant counts an empty batch too)."""
        import torch

        params = [p for p in self.model.parameters() if p.requires_grad]
        if batch:
            sums = self.clipped_sum(self.per_example_grads(inputs, target))
        else:
            sums = [torch.zeros_like(p) for p in params]
        std = self.plan.noise_multiplier * self.plan.clip_norm
        for p, s in zip(params, sums, strict=True):
            noise = torch.from_numpy(generator.normal(0.0, std, size=tuple(p.shape))).to(p.device, p.dtype)
            p.grad = (s.to(p.dtype) + noise) / self.plan.expected_batch
