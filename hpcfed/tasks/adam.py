"""Adam and AdamW for the built-in tasks, on torch's own per-step function (`torch.optim.adam.adam`).

torch's optimizer classes import `torch._dynamo`, the compiler, the first time one is built or
stepped (`Optimizer.add_param_group` and `step` are wrapped to keep the compiler out of them). That
import costs about as much CPU as importing torch itself, and a site that trains eagerly never
compiles, so every client rank of every run paid it for nothing. `Adam` keeps the same state and
calls the same functional step with the same arguments, so its arithmetic is torch's, bit for bit
(tests/tasks/test_adam.py checks steps, weight decay, AdamW and a save/load against
`torch.optim.Adam`/`AdamW`), without that import.

Its state dict has torch's layout (``state`` by parameter index: ``step``, ``exp_avg``,
``exp_avg_sq``; ``param_groups`` with torch's keys), so `torch_state.optimizer_state` saves it as
before and a checkpoint written by either class resumes in the other.
"""

from __future__ import annotations

from typing import Any

_GROUP_DEFAULTS: dict[str, Any] = {
    "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
    "capturable": False, "differentiable": False, "fused": None,
}


class OneGroup:
    """What this module's `Adam` and `hpcfed.tasks.sgd.SGD` share: one group of parameters on an eager,
    single-device model, torch's ``zero_grad`` and ``state_dict`` layout, and taking a saved group."""

    def __init__(self, params: Any, group: dict[str, Any]) -> None:
        self.params: list[Any] = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
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

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}``, torch's layout."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        state = {i: dict(self.state[p]) for i, p in enumerate(self.params) if p in self.state}
        return {"state": state, "param_groups": [group]}

    def take_group(self, state_dict: dict[str, Any]) -> dict[int, Any]:
        """Take the hyperparameters of `state_dict`'s one group (refused when it is not one group of these
        parameters); the parameter of each saved index, for the caller to load its per-parameter state."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"optimizer state for {[len(g['params']) for g in groups]} parameters in "
                             f"{len(groups)} group(s) does not fit {len(self.params)} parameters in one group")
        saved = groups[0]
        self.param_groups = [{**self.param_groups[0], **{k: v for k, v in saved.items() if k != "params"},
                              "params": self.params}]
        self.state = {}
        return {int(idx): p for idx, p in zip(saved["params"], self.params, strict=True)}


class Adam(OneGroup):
    """`torch.optim.Adam` (or `AdamW` with ``decoupled_weight_decay=True``) for one group of
    parameters on an eager, single-device model: ``zero_grad``, ``step``, ``state_dict`` and
    ``load_state_dict`` as torch's."""

    def __init__(self, params: Any, *, lr: float, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False) -> None:
        super().__init__(params, {"lr": lr, **_GROUP_DEFAULTS, "weight_decay": weight_decay,
                                  "decoupled_weight_decay": decoupled_weight_decay})

    def step(self) -> None:
        """One Adam step over the parameters that have a gradient (torch's functional `adam`)."""
        import torch
        from torch.optim.adam import adam

        g = self.param_groups[0]
        params, grads, avgs, sqs, maxes, steps = [], [], [], [], [], []
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                state = self.state.get(p)
                if state is None:
                    state = self.state[p] = {
                        "step": torch.tensor(0.0, dtype=torch.get_default_dtype()),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                    if g["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                if g["amsgrad"]:
                    maxes.append(state["max_exp_avg_sq"])
            if not params:
                return
            beta1, beta2 = g["betas"]
            adam(params, grads, avgs, sqs, maxes, steps, foreach=g["foreach"], capturable=g["capturable"],
                 differentiable=g["differentiable"], fused=g["fused"], grad_scale=None, found_inf=None,
                 has_complex=any(torch.is_complex(p) for p in params),
                 decoupled_weight_decay=g["decoupled_weight_decay"], amsgrad=g["amsgrad"], beta1=beta1,
                 beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=g["maximize"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the hyperparameters and per-parameter state of `state_dict` (this class's or torch's):
        moments are cast to their parameter's dtype and device, ``step`` is kept as it is (as torch does)."""
        import torch

        index = self.take_group(state_dict)
        self.param_groups[0]["betas"] = tuple(self.param_groups[0]["betas"])
        for idx, entry in state_dict["state"].items():
            p = index[int(idx)]
            self.state[p] = {key: (torch.as_tensor(value) if key == "step"
                                   else torch.as_tensor(value).to(dtype=p.dtype, device=p.device))
                             for key, value in entry.items()}
