"""SGD with momentum for the built-in tasks, on torch's own per-step function (`torch.optim.sgd.sgd`).

The counterpart of `hpcfed.tasks.adam.Adam`, for the same reason: torch's optimizer classes import
`torch._dynamo`, the compiler, the first time one is built or stepped, which costs a site rank about
as much CPU as importing torch. `SGD` keeps torch's state (``momentum_buffer`` per parameter) and
calls the same functional step with the same arguments, so its arithmetic is `torch.optim.SGD`'s bit
for bit (tests/tasks/test_adam.py), and its state dict has torch's layout, so a checkpoint written
by either class resumes in the other.

Under record-level DP (`privacy.record_dp`) the quickstart takes it with ``task.optimizer: sgd``: SGD
moves each coordinate by the noisy gradient itself, where Adam divides by its running scale and so
moves every coordinate about ``lr`` a step, noise or not (docs/guides/privacy.md).
"""

from __future__ import annotations

from typing import Any

from hpcfed.tasks.adam import OneGroup

_GROUP_DEFAULTS: dict[str, Any] = {
    "dampening": 0.0, "nesterov": False, "maximize": False, "foreach": None, "differentiable": False,
    "fused": None,
}


class SGD(OneGroup):
    """`torch.optim.SGD` for one group of parameters on an eager, single-device model: ``zero_grad``,
    ``step``, ``state_dict`` and ``load_state_dict`` as torch's."""

    def __init__(self, params: Any, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        if not lr > 0 or not 0.0 <= momentum < 1.0:
            raise ValueError(f"SGD needs lr > 0 and 0 <= momentum < 1, got lr {lr}, momentum {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum, **_GROUP_DEFAULTS, "weight_decay": weight_decay})

    def step(self) -> None:
        """One SGD step over the parameters that have a gradient (torch's functional `sgd`)."""
        import torch
        from torch.optim.sgd import sgd

        g = self.param_groups[0]
        params = [p for p in self.params if p.grad is not None]
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError("this SGD does not take sparse gradients")
        if not params:
            return
        buffers = [self.state.get(p, {}).get("momentum_buffer") for p in params]
        with torch.no_grad():
            sgd(params, [p.grad for p in params], buffers, foreach=g["foreach"], fused=g["fused"], grad_scale=None,
                found_inf=None, weight_decay=g["weight_decay"], momentum=g["momentum"], lr=g["lr"],
                dampening=g["dampening"], nesterov=g["nesterov"], maximize=g["maximize"])
        if g["momentum"]:  # the functional step fills the list with the buffers it made on the first step
            for p, buf in zip(params, buffers, strict=True):
                self.state.setdefault(p, {})["momentum_buffer"] = buf

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the hyperparameters and momentum buffers of `state_dict` (this class's or torch's); a state
        of another optimizer (Adam's moments) is refused, naming what it holds."""
        import torch

        saved = state_dict["param_groups"][0] if state_dict["param_groups"] else {}
        if "momentum" not in saved:
            keys = sorted(k for k in saved if k != "params")
            raise ValueError(f"optimizer state is not SGD's (its settings: {keys}); resume with the task.optimizer "
                             f"the checkpoint was made with")
        for idx, entry in state_dict["state"].items():
            unknown = sorted(set(entry) - {"momentum_buffer"})
            if unknown:
                raise ValueError(f"optimizer state of parameter {idx} holds {unknown}, not SGD's momentum_buffer; "
                                 f"resume with the task.optimizer the checkpoint was made with")
        index = self.take_group(state_dict)
        for idx, entry in state_dict["state"].items():
            if entry.get("momentum_buffer") is not None:
                p = index[int(idx)]
                self.state[p] = {"momentum_buffer": torch.as_tensor(entry["momentum_buffer"]).to(
                    dtype=p.dtype, device=p.device)}
