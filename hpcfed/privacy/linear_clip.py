"""DP-SGD's clipped sum for a model whose trainable parameters all sit in `nn.Linear` layers, in one
forward and one backward pass, without per-example gradients for 2-D inputs.

For a linear layer y = W a + b on a batch of 2-D inputs (one row per example), example i's gradient
of W is g_i a_iᵀ (g_i: the loss's gradient at the layer's output for that example), so its squared
norm is ‖g_i‖² ‖a_i‖², and its bias gradient's is ‖g_i‖². The whole model's per-example norms come
from those sums, and the clipped sum of the weights' gradients is one product, (f ⊙ G)ᵀ A, with f_i =
min(1, C / ‖example i's gradient‖). This is "book-keeping" clipping (Bu et al. 2023, "Differentially
private optimization on large model at small cost"): the same clipped sum as per-example gradients
give, at the cost of a plain step plus a few products of the layer's activations. On the quickstart's
MLP a round's steps take about half the CPU of Opacus's hook path (a quarter at full batch), whose
per-layer Python work dominates a small model's step (docs/benchmarks.md, "Record-level DP").

Inputs with more dimensions (a sequence: batch x tokens x features, as LoRA adapters see them) get
their per-example weight gradients as one batched product, Σ_t g_it a_itᵀ, then the same clipping.

The gradients at the layers' outputs come from `torch.autograd.grad` over the outputs that forward
hooks record, so no parameter's `.grad` is computed twice and no backward hook runs. A model this
does not fit (a trainable parameter outside a linear layer, a layer called twice in one forward, a
layer whose rows are not the batch's examples) returns None and the site takes Opacus's hooks.
"""

from __future__ import annotations

from typing import Any


class LinearClip:
    """Forward hooks on a model's trainable linear layers, for one round's clipped sums."""

    def __init__(self, layers: list[Any], params: list[Any]) -> None:
        self.layers = layers
        self.params = params
        self._seen: list[tuple[Any, Any, Any]] = []
        self._handles: list[Any] = []

    @classmethod
    def for_model(cls, model: Any, params: list[Any]) -> LinearClip | None:
        """The clipper of `model`, or None when a trainable parameter is not a linear layer's own."""
        from torch import nn

        layers = [m for m in model.modules() if isinstance(m, nn.Linear)
                  and any(p.requires_grad for p in m.parameters(recurse=False))]
        owned = [id(p) for m in layers for p in m.parameters(recurse=False) if p.requires_grad]
        if not layers or sorted(owned) != sorted(id(p) for p in params) or len(set(owned)) != len(owned):
            return None
        return cls(layers, params)

    @property
    def attached(self) -> bool:
        """Whether the hooks are on (inside a round's steps)."""
        return bool(self._handles)

    def attach(self) -> None:
        """Record each trainable linear layer's input and output at every forward (for a round's steps)."""
        if not self._handles:
            self._handles = [m.register_forward_hook(self._record) for m in self.layers]

    def detach(self) -> None:
        """Remove the hooks: the model is as the task built it."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._seen = []

    def _record(self, module: Any, inputs: tuple[Any, ...], output: Any) -> None:
        self._seen.append((module, inputs[0] if inputs else None, output))

    def clipped_sum(self, loss: Any, batch: int, clip_norm: float) -> list[Any] | None:
        """Σ_i clip(g_i, C) of each trainable parameter (in `params` order) for the batch whose mean loss
        `loss()` computes, or None when this forward does not fit the method (see the module's text)."""
        import torch

        self._seen = []
        value = loss()
        seen, self._seen = self._seen, []
        if (len(seen) != len(self.layers) or {id(m) for m, _, _ in seen} != {id(m) for m in self.layers}
                or any(a is None or not torch.is_tensor(o) or not o.requires_grad or a.dim() < 2
                       or a.shape[0] != batch or o.shape[0] != batch for _, a, o in seen)):
            return None
        outs = torch.autograd.grad(value * batch, [o for _, _, o in seen], allow_unused=True)
        norms = torch.zeros(batch, dtype=torch.float32, device=seen[0][2].device)
        # (layer, input, output gradient, per-example weight and bias gradients or None)
        parts: list[tuple[Any, Any, Any, Any, Any]] = []
        for (module, a, out), g in zip(seen, outs, strict=True):
            a = a.detach()
            g = torch.zeros_like(out) if g is None else g
            bias = module.bias is not None and module.bias.requires_grad
            if a.dim() == 2:
                sq_g = g.float().pow(2).sum(1)
                if module.weight.requires_grad:
                    norms += sq_g * a.float().pow(2).sum(1)
                if bias:
                    norms += sq_g
                parts.append((module, a, g, None, None))
                continue
            a3, g3 = a.reshape(batch, -1, a.shape[-1]), g.reshape(batch, -1, g.shape[-1])
            per_w = torch.bmm(g3.transpose(1, 2), a3) if module.weight.requires_grad else None
            per_b = g3.sum(1) if bias else None
            for per in (per_w, per_b):
                if per is not None:
                    norms += per.flatten(1).float().pow(2).sum(1)
            parts.append((module, a, g, per_w, per_b))
        factor = torch.clamp(clip_norm / (norms.sqrt() + 1e-6), max=1.0)
        sums: dict[int, Any] = {}
        for module, a, g, per_w, per_b in parts:
            f = factor.to(g.dtype)
            if per_w is None and per_b is None and a.dim() == 2:
                fg = g * f[:, None]
                if module.weight.requires_grad:
                    sums[id(module.weight)] = fg.T @ a
                if module.bias is not None and module.bias.requires_grad:
                    sums[id(module.bias)] = fg.sum(0)
                continue
            if per_w is not None:
                sums[id(module.weight)] = torch.tensordot(f, per_w, dims=1)
            if per_b is not None:
                sums[id(module.bias)] = f @ per_b
        return [sums[id(p)] for p in self.params]
