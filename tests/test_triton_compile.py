"""The Triton attention kernels compile for a Hopper GPU (sm_90) without one: front end, layout
passes, LLVM and the ptxas that ships with triton, at the tiles the wrappers launch with on a GPU.
The interpreter runs the same bodies but skips all of that (dot shapes, globals, layouts)."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from radixserve.kernels.triton_ops import decode, extend

HOPPER = GPUTarget("cuda", 90, 32)
INDEX_ARGS = {"KV_INDICES": "*i64", "SEQ_LENS": "*i64", "CU_EXTEND": "*i64"}


def _compile(kernel, pointers: dict[str, str], constexprs: dict, **options):
    """Arguments not named in `pointers` or `constexprs` are the int32 strides (and the scale)."""
    fn = kernel._compiled
    signature = {
        name: "constexpr"
        if name in constexprs
        else pointers.get(name, "fp32" if name == "qk_scale" else "i32")
        for name in fn.arg_names
    }
    return triton.compile(ASTSource(fn, signature, constexprs), target=HOPPER, options=options)


def _dots(dtype: str) -> dict:
    return {"DOT_F32": dtype == "fp32", "PRECISION": "ieee" if dtype == "fp32" else "tf32"}


def test_decode_kernels_compile_for_hopper():
    dtype = "bf16"
    # Llama-3-8B: 32 query heads on 8 KV heads of 128 dims, batch 1 with 16 splits.
    block_h, block_n = decode.decode_tiles(4, 128)
    pointers = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "MID_O": "*fp32", "MID_LSE": "*fp32"}
    constexprs = {"GROUP": 4, "HEAD_CHUNKS": 1, "BLOCK_H": block_h, "HEAD_DIM": 128, "BLOCK_N": block_n}
    split = _compile(
        decode._SPLIT, pointers | INDEX_ARGS, constexprs | {"NUM_SPLITS": 16} | _dots(dtype), num_warps=4
    )
    assert split.asm["cubin"] and ".reqntid 128" in split.asm["ptx"]
    merge = _compile(
        decode._MERGE,
        {"MID_O": "*fp32", "MID_LSE": "*fp32", "OUT": f"*{dtype}"},
        {"HEAD_DIM": 128, "NUM_SPLITS": 16, "SPLITS_POW2": 16},
        num_warps=4,
    )
    assert merge.asm["cubin"]


def test_extend_kernel_compiles_for_hopper():
    # The default model's layout: 9 query heads on 3 KV heads of 64 dims.
    block_m, block_n, num_warps = extend.extend_tiles(64, on_gpu=True)
    pointers = {name: "*bf16" for name in ("Q", "K", "V", "OUT")}
    constexprs = {"GROUP": 3, "HEAD_DIM": 64, "BLOCK_M": block_m, "BLOCK_N": block_n} | _dots("bf16")
    kernel = _compile(extend._EXTEND, pointers | INDEX_ARGS, constexprs, num_warps=num_warps, num_stages=2)
    assert kernel.asm["cubin"] and f".reqntid {32 * num_warps}" in kernel.asm["ptx"]
