"""Helpers for tasks built on torch: parameters <-> numpy, and resumable optimizer/RNG state.

Optimizer state travels as named arrays (``opt/<param index>/<key>``) plus a JSON header of its
scalars, never as a pickled state_dict.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcfed.comm.wire import bfloat16
from hpcfed.params import Params, is_bfloat16, wire_dtype


def module_parameters(module: Any) -> Params:
    """A module's state (parameters and buffers) as numpy arrays, in state_dict order. Each keeps its
    dtype when the wire carries it (float32/16, bfloat16, integers, bool); others become float32."""
    return {k: to_numpy(v) for k, v in module.state_dict().items()}


def to_numpy(tensor: Any) -> np.ndarray:
    """A copy of a torch tensor as numpy, in the dtype the wire carries (`hpcfed.params.wire_dtype`)."""
    import torch

    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits as ml_dtypes.bfloat16
        bits: np.ndarray = t.contiguous().view(torch.int16).numpy().view(bfloat16()).copy()
        return bits
    arr = t.numpy()
    out: np.ndarray = arr.astype(wire_dtype(arr.dtype), copy=True)
    return out


def to_torch(arr: np.ndarray) -> Any:
    """A numpy array (bfloat16 included) as a torch tensor of the same dtype."""
    import torch

    arr = np.asarray(arr)
    if is_bfloat16(arr.dtype):
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16).copy()).view(torch.bfloat16)
    return torch.as_tensor(arr)


def load_module_parameters(module: Any, params: Params) -> None:
    """Load named arrays into a torch module's parameters, refusing missing names or wrong shapes."""
    import torch

    state = module.state_dict()
    missing = set(state) - set(params)
    if missing:
        raise ValueError(f"parameters missing for {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(to_torch(params[name]).to(tensor.dtype).reshape(tensor.shape))


def optimizer_state(optimizer: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Header (param_groups and per-parameter scalars) + arrays of a torch optimizer's state."""
    import torch

    sd = optimizer.state_dict()
    arrays: dict[str, np.ndarray] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for key, value in entry.items():
            if hasattr(value, "numpy"):
                # bf16 moments are kept as float32 (exact); load_state_dict casts them back to the
                # parameter's dtype. HDF5 has no bfloat16.
                tensor = value.detach().cpu()
                arr = tensor.float().numpy() if value.dtype == torch.bfloat16 else tensor.numpy()
                if arr.ndim == 0:
                    scalars.setdefault(str(idx), {})[key] = arr.item()
                else:
                    arrays[f"opt/{idx}/{key}"] = arr.copy()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return {"param_groups": groups, "scalars": scalars}, arrays


def load_optimizer_state(optimizer: Any, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Restore an optimizer from `optimizer_state`'s header and arrays, so a resumed site trains on as
    if it had never stopped."""
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
    """torch's global random state as checkpoint arrays, so a resumed site draws what it would have drawn."""
    import torch

    return {}, {"rng/torch": torch.get_rng_state().numpy().copy()}


def load_rng_state(arrays: dict[str, np.ndarray]) -> None:
    """Restore torch's global random state saved by `rng_state` (left as is when the arrays hold none)."""
    import torch

    if "rng/torch" in arrays:
        torch.set_rng_state(torch.as_tensor(np.asarray(arrays["rng/torch"], dtype=np.uint8)))


def training_state(optimizer: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A torch task's resumable core: ``({"optimizer": header}, optimizer arrays + torch RNG)``;
    a task adds its own keys to both."""
    header, arrays = optimizer_state(optimizer)
    _, rng = rng_state()
    return {"optimizer": header}, {**arrays, **rng}


def load_training_state(optimizer: Any, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Undo `training_state` (a header without "optimizer", from before any step, leaves it as is)."""
    if "optimizer" in header:
        load_optimizer_state(optimizer, header["optimizer"], {k: v for k, v in arrays.items() if k.startswith("opt/")})
    load_rng_state(arrays)


def saved_vector(arrays: dict[str, np.ndarray], key: str, size: int, default: np.ndarray | None) -> np.ndarray | None:
    """A saved flat model vector of `size` float32 values, or `default` when the state has none; one of
    another size (another model's state, or a damaged one) is refused, naming the array."""
    if key not in arrays:
        return default
    flat = np.array(arrays[key], dtype=np.float32)
    if flat.shape != (size,):
        raise ValueError(f"saved site state: array {key!r} has shape {flat.shape}, expected ({size},) for this "
                         f"model; the state is of another model or damaged: resume from another checkpoint or "
                         f"start afresh")
    return flat
