"""Torch state as the named numpy arrays a tensor blob holds (schemas/tensor_blob.py).

Module parameters and buffers are copied by state_dict name. Optimizer state dicts are nested;
they are flattened to `state.<param index>.<name>` tensors plus the JSON of `param_groups` and the
non-tensor state, which goes into the blob's metadata.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from schemas.tensor_blob import TensorBlobError


def module_tensors(module: torch.nn.Module, skip: set[str]) -> dict[str, np.ndarray]:
    """Copies of a module's parameters and buffers by state_dict name, except those in `skip`."""
    return {
        name: value.detach().to("cpu", copy=True).numpy()
        for name, value in module.state_dict().items()
        if name not in skip
    }


def flatten_optimizer_state(
    state: dict[str, Any],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Split a torch optimizer state_dict into tensors and JSON metadata."""
    tensors: dict[str, np.ndarray] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().to("cpu", copy=True).numpy()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(
    tensors: dict[str, np.ndarray], meta: dict[str, Any]
) -> dict[str, Any]:
    """The torch optimizer state_dict that `flatten_optimizer_state` split."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        prefix, index, name = key.split(".", 2)
        if prefix != "state":
            raise TensorBlobError(f"unexpected optimizer tensor {key!r}")
        state.setdefault(int(index), {})[name] = torch.from_numpy(value.copy())
    for index, values in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}
