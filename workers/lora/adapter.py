"""A PEFT LoRA adapter: read from its directory, checked against the served model, cut to this
rank's shard, its scaling folded into B.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] for each adapted
projection. The delta of a projection is `x @ A^T @ B^T * scale`, scale = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)); `alpha_pattern` / `rank_pattern` give some modules their own alpha / rank.

What the engine cannot serve is refused with a reason, never half-applied: DoRA, trained biases,
modules saved whole (`modules_to_save`), embeddings or the LM head as targets, layer replication,
a rank over the engine's maximum, shapes that do not match the model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.workers.models.linear import FusedLinear, Linear, narrow
from radixserve.workers.models.weight_loader import FUSED

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target (checkpoint names).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+\.(?P<leaf>\w+))\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter this engine cannot serve; the message says why."""


@dataclass
class ModuleLoRA:
    """One adapted projection of this rank: A [r, in] and B [out, r] (scale folded in) per fused
    part (None for an unfused projection), in the model's dtype."""

    parts: dict[int | None, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    modules: dict[str, ModuleLoRA]  # by the model's module name (model.layers.3.self_attn.qkv_proj)

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for m in self.modules.values()
            for a, b in m.parts.values()
        )


def read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{path!r} is not a LoRA adapter directory: it has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{file!r} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{file!r} is not a JSON object")
    return config


def config_rank(path: str) -> int:
    """The largest rank an adapter directory declares (its `r` and `rank_pattern`)."""
    config = read_config(path)
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        raise LoRAError(f"{path!r}: the ranks of an adapter are positive integers")
    return max(ranks)


def check_config(config: dict[str, Any]) -> None:
    """Refuse what the engine does not apply (instead of serving a different model)."""
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"only LoRA adapters are served, not {kind}")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters that save whole modules (modules_to_save) are not supported",
        "layer_replication": "layer replication is not supported",
        "lora_bias": "LoRA biases are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters are not supported",
    }
    for key, reason in refusals.items():
        if config.get(key):
            raise LoRAError(reason)
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapters with trained biases (bias={config['bias']!r}) are not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key, 8), (int, float)) or config.get(key, 8) <= 0:
            raise LoRAError(f"{key} must be a positive number")


def _pattern(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's per-module override: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(name: str, path: str, model: nn.Module, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read the adapter at `path` and cut it to the shard of `model` (this rank's model)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(path)
    check_config(config)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        raise LoRAError(f"{path!r} has no {WEIGHTS_FILE} (only safetensors adapters are loaded)")
    try:
        tensors = load_file(file, device="cpu")
    except (OSError, SafetensorError, ValueError) as exc:
        raise LoRAError(f"{file!r} cannot be read: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"tensor {key!r} is not a LoRA A/B weight this engine applies")
        if m["leaf"] not in TARGETS:
            raise LoRAError(f"{m['module']!r}: only {', '.join(TARGETS)} may be adapted")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise LoRAError(f"{file!r} holds no LoRA weights")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    modules: dict[str, ModuleLoRA] = {}
    top = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{module!r} has lora_{'B' if 'A' in ab else 'A'} missing")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} are not a LoRA pair")
        r = a.shape[0]
        if r > max_rank:
            raise LoRAError(f"{module!r} has rank {r}, over the maximum LoRA rank {max_rank}")
        top = max(top, r)
        scale = float(_pattern(config.get("alpha_pattern"), module, alpha))
        scale = scale / math.sqrt(r) if rslora else scale / r
        target, part = _target(model, module)
        a_local, b_local = _shard(target, part, module, a, b, model.config)
        entry = modules.setdefault(_owner(module), ModuleLoRA({}))
        entry.parts[part] = (
            a_local.to(dtype).contiguous(),
            (b_local.float() * scale).to(dtype).contiguous(),
        )
    return LoRAAdapter(name, path, top, modules)


def _owner(module: str) -> str:
    *path, leaf = module.split(".")
    return ".".join([*path, FUSED[leaf][0] if leaf in FUSED else leaf])


def _target(model: nn.Module, module: str) -> tuple[Linear, int | None]:
    leaf = module.rsplit(".", 1)[-1]
    part = FUSED[leaf][1] if leaf in FUSED else None
    try:
        target = model.get_submodule(_owner(module))
    except AttributeError:
        raise LoRAError(f"{module!r} is not a projection of this model") from None
    if not isinstance(target, Linear) or (part is not None) != isinstance(target, FusedLinear):
        raise LoRAError(f"{module!r} is not a projection of this model")
    return target, part


def full_shape(config: Any, leaf: str) -> tuple[int, int]:
    """(out, in) of checkpoint projection `leaf` in the whole (unsharded) model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[leaf]


def _shard(
    target: Linear, part: int | None, module: str, a: torch.Tensor, b: torch.Tensor, config: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A and B: the rows of B that the base layer holds of its output (a fused part's
    rows, a column-parallel shard) and the columns of A that it holds of its input (row-parallel)."""
    out, inp = full_shape(config, module.rsplit(".", 1)[-1])
    if b.shape[0] != out or a.shape[1] != inp:
        raise LoRAError(
            f"{module!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the model's projection "
            f"({inp} in, {out} out)"
        )
    rows = target.parts[part] if isinstance(target, FusedLinear) and part is not None else target.rows
    if rows is not None:
        b = narrow(b, 0, rows)
    if target.cols is not None:
        a = narrow(a, 1, target.cols)
    return a, b
