"""SGD with momentum for the built-in tasks, on torch's own per-step function (`torch.optim.sgd.sgd`).

The counterpart of `hpcfed.tasks.adam.Adam`, for the same reason: torch's optimizer classes import
`torch._dynamo`, the compiler, the first time one is built or stepped, which costs a site rank about
as much CPU as importing torch. `SGD` keeps torch's state (``momentum_buffer`` per parameter) and
calls the same functional step with the same arguments, so its arithmetic is `torch.optim.SGD`'s bit
for bit (tests/tasks/test_sgd.py), and its state dict has torch's layout, so a checkpoint written
by either class resumes in the other.

Under record-level DP (`privacy.record_dp`) the quickstart takes it with ``task.optimizer: sgd``: SGD
moves each coordinate by the noisy gradient itself, where Adam divides by its running scale and so
moves every coordinate about ``lr`` a step, noise or not (docs/guides/privacy.md).
"""

from __future__ import annotations

from typing import Any

_GROUP_DEFAULTS: dict[str, Any] = {
    "dampening": 0.0, "nesterov": False, "maximize": False, "foreach": None, "differentiable": False,
    "fused": None,
}


class SGD:
    """`torch.optim.SGD` for one group of parameters on an eager, single-device model: ``zero_grad``,
    ``step``, ``state_dict`` and ``load_state_dict`` as torch's."""

    def __init__(self, params: Any, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.params: list[Any] = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        if not lr > 0 or not 0.0 <= momentum < 1.0:
            raise ValueError(f"SGD needs lr > 0 and 0 <= momentum < 1, got lr {lr}, momentum {momentum}")
        group = {"lr": lr, "momentum": momentum, **_GROUP_DEFAULTS, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = [{**group, "params": self.params}]
        self.state: dict[Any, dict[str, Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (to None by default, as torch does)."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.requires_grad_(False)
                p.grad.zero_()

    def step(self) -> None:
        """One SGD step over the parameters that have a gradient (torch's functional `sgd`)."""
        import torch
        from torch.optim.sgd import sgd

        g = self.param_groups[0]
        params, grads, buffers = [], [], []
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("this SGD does not take sparse gradients")
                params.append(p)
                grads.append(p.grad)
                buffers.append(self.state.get(p, {}).get("momentum_buffer"))
            if not params:
                return
            sgd(params, grads, buffers, foreach=g["foreach"], fused=g["fused"], grad_scale=None, found_inf=None,
                weight_decay=g["weight_decay"], momentum=g["momentum"], lr=g["lr"], dampening=g["dampening"],
                nesterov=g["nesterov"], maximize=g["maximize"])
            if g["momentum"]:  # the functional step fills the list with the buffers it made on the first step
                for p, buf in zip(params, buffers, strict=True):
                    self.state.setdefault(p, {})["momentum_buffer"] = buf

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {"momentum_buffer": ...}}, "param_groups": [{..., "params": [indices]}]}``."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        state = {i: dict(self.state[p]) for i, p in enumerate(self.params) if p in self.state}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the hyperparameters and momentum buffers of `state_dict` (this class's or torch's); a state
        of another optimizer (Adam's moments) is refused, naming what it holds."""
        import torch

        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"optimizer state for {[len(g['params']) for g in groups]} parameters in "
                             f"{len(groups)} group(s) does not fit {len(self.params)} parameters in one group")
        saved = groups[0]
        if "momentum" not in saved:
            keys = sorted(k for k in saved if k != "params")
            raise ValueError(f"optimizer state is not SGD's (its settings: {keys}); resume with the task.optimizer "
                             f"the checkpoint was made with")
        index = {idx: p for idx, p in zip(saved["params"], self.params, strict=True)}
        self.param_groups = [{**self.param_groups[0], **{k: v for k, v in saved.items() if k != "params"},
                              "params": self.params}]
        self.state = {}
        for idx, entry in state_dict["state"].items():
            p = index[int(idx)]
            unknown = sorted(set(entry) - {"momentum_buffer"})
            if unknown:
                raise ValueError(f"optimizer state of parameter {idx} holds {unknown}, not SGD's momentum_buffer; "
                                 f"resume with the task.optimizer the checkpoint was made with")
            if entry.get("momentum_buffer") is not None:
                self.state[p] = {"momentum_buffer": torch.as_tensor(entry["momentum_buffer"]).to(
                    dtype=p.dtype, device=p.device)}
