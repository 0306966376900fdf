"""Where a rank computes: the `--device` choices, and the torch device and group backend they mean.

"auto" is the GPU where torch sees one, else the CPU. "cuda" asks for the GPU and is a clear
start-up error where there is none. Every rank of a replica runs on the same kind of device;
rank r of a tensor-parallel group takes CUDA device r modulo the devices it sees (a Ray actor
granted one GPU sees exactly that one, as device 0; local processes on a multi-GPU host see all).
"""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")


def gpu_count() -> int:
    """The CUDA devices torch sees here, 0 without CUDA: what "auto" goes by (one seam, so that a
    test can answer it as a GPU host would)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_kind(name: str) -> str:
    """ "cpu" or "cuda" for a `--device` choice, resolved on this host (no error for "cuda")."""
    if name not in DEVICES:
        raise ValueError(f"device {name!r} is not supported; supported devices: {', '.join(DEVICES)}")
    if name == "auto":
        return "cuda" if gpu_count() > 0 else "cpu"
    return name


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The torch device rank `rank` of a replica computes on; raises where "cuda" has no GPU."""
    kind = device_kind(name)
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = "this torch is a CPU-only build" if build is None else f"torch (CUDA {build}) sees no GPU"
        raise RuntimeError(f"--device cuda was asked for, but {why}; run with --device cpu or auto")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def comm_backend(device: torch.device) -> str:
    """The torch.distributed backend of a group whose ranks compute on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"
