"""Checkpoint tensors (Hugging Face names) into a model built by this package, shard by shard.

Each tensor goes to the module its name points at. Modules with `load_checkpoint(kind, tensor,
part)` cut their own slice (tensor-parallel shards, fused q/k/v and gate/up parts); any other
parameter takes the tensor whole. Experts another rank holds (expert parallelism) are skipped.
Every parameter must be loaded, or the load fails naming what is missing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from radixserve.workers.models.linear import FusedLinear

# checkpoint leaf module -> (our fused module, part index)
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)(\..*)?$")

Loaded = set[tuple[str, str, int | None]]  # (module, kind, fused part)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str],
    skip: Callable[[str], bool],
) -> None:
    """rename(name): a checkpoint name in the model's layout; skip(name): checkpoint tensors the
    model does not use (rotary tables, a tied head)."""
    loaded: Loaded = set()
    for name, tensor in weights:
        name = rename(name)
        if skip(name):
            continue
        *path, leaf, kind = name.split(".")
        part = None
        if leaf in FUSED:
            leaf, part = FUSED[leaf]
        module_name = ".".join([*path, leaf])
        if _held_elsewhere(model, module_name):
            continue
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}") from None
        try:
            _load_one(module, kind, tensor, part)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        loaded.add((module_name, kind, part))
    missing = _missing(model, loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:8]}")


def _load_one(module: nn.Module, kind: str, tensor: torch.Tensor, part: int | None) -> None:
    loader = getattr(module, "load_checkpoint", None)
    if loader is not None:
        loader(kind, tensor, part)
        return
    target = getattr(module, kind, None)
    if not isinstance(target, nn.Parameter) or part is not None:
        raise ValueError(f"{type(module).__name__} has no parameter {kind!r}")
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def _held_elsewhere(model: nn.Module, module_name: str) -> bool:
    """An expert of a sparse block that another expert-parallel rank holds."""
    match = _EXPERT.match(module_name)
    if match is None:
        return False
    block = model.get_submodule(match[1])
    held = getattr(block, "holds_expert", None)
    return held is not None and not held(int(match[2]))


def _missing(model: nn.Module, loaded: Loaded) -> list[str]:
    missing = []
    for name, _ in model.named_parameters():
        module_name, kind = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        parts = range(module.num_parts) if isinstance(module, FusedLinear) else [None]
        if not all((module_name, kind, p) in loaded for p in parts):
            missing.append(name)
    return sorted(missing)
