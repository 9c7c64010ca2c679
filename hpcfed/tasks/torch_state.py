"""Helpers for tasks built on torch: parameters <-> numpy, and resumable optimizer/RNG state.

Optimizer state travels as named arrays (``opt/<param index>/<key>``) plus a JSON header of its
scalars, never as a pickled state_dict.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcfed.params import Params


def module_parameters(module: Any) -> Params:
    """A module's state (parameters and buffers) as float32 numpy arrays, in state_dict order."""
    return {k: v.detach().cpu().numpy().astype(np.float32, copy=True) for k, v in module.state_dict().items()}


def load_module_parameters(module: Any, params: Params) -> None:
    import torch

    state = module.state_dict()
    missing = set(state) - set(params)
    if missing:
        raise ValueError(f"parameters missing for {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(torch.as_tensor(np.asarray(params[name])).to(tensor.dtype).reshape(tensor.shape))


def optimizer_state(optimizer: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Header (param_groups and per-parameter scalars) + arrays of a torch optimizer's state."""
    sd = optimizer.state_dict()
    arrays: dict[str, np.ndarray] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for key, value in entry.items():
            if hasattr(value, "numpy"):
                arr = value.detach().cpu().numpy()
                if arr.ndim == 0:
                    scalars.setdefault(str(idx), {})[key] = arr.item()
                else:
                    arrays[f"opt/{idx}/{key}"] = arr.copy()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return {"param_groups": groups, "scalars": scalars}, arrays


def load_optimizer_state(optimizer: Any, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    import torch

    state: dict[int, dict[str, Any]] = {}
    for name, arr in arrays.items():
        _, idx, key = name.split("/", 2)
        state.setdefault(int(idx), {})[key] = torch.as_tensor(np.array(arr))
    for idx, entry in header.get("scalars", {}).items():
        for key, value in entry.items():
            state.setdefault(int(idx), {})[key] = torch.tensor(float(value)) if key == "step" else value
    optimizer.load_state_dict({"state": state, "param_groups": header["param_groups"]})


def rng_state() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    import torch

    return {}, {"rng/torch": torch.get_rng_state().numpy().copy()}


def load_rng_state(arrays: dict[str, np.ndarray]) -> None:
    import torch

    if "rng/torch" in arrays:
        torch.set_rng_state(torch.as_tensor(np.asarray(arrays["rng/torch"], dtype=np.uint8)))
