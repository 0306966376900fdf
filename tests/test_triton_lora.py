"""The Triton LoRA kernels (kernels/triton_ops/lora.py) against the per-token reference: run by
Triton's interpreter on CPU tensors, compiled on a GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.triton_ops.lora import lora_add

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def case(dtype, tokens_slots, k=40, outs=((0, 24), (24, 32), (32, 40)), slots=4, rank=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    parts = len(outs)
    A = torch.randn(slots, k, parts, rank, generator=gen).to(dtype)
    Bs = [torch.randn(slots, rank, hi - lo, generator=gen).to(dtype) for lo, hi in outs]
    x = torch.randn(len(tokens_slots), k, generator=gen).to(dtype)
    y = torch.randn(len(tokens_slots), outs[-1][1], generator=gen).to(dtype)
    want = y.float().clone()
    for t, s in enumerate(tokens_slots):
        if s < 0:
            continue
        xa = x[t].float() @ A[s].float().view(k, parts * rank)
        for p, (lo, hi) in enumerate(outs):
            want[t, lo:hi] += xa[p * rank : (p + 1) * rank] @ Bs[p][s].float()
    return x, y, A, Bs, list(outs), torch.tensor(tokens_slots, dtype=torch.int32), want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "token_slots", [[0, 1, -1, 3, 1, 2, -1, 0], [2] * 5, [-1, -1, -1]], ids=["mixed", "one", "base"]
)
def test_lora_add_equals_the_per_token_reference(device, dtype, token_slots):
    x, y, A, Bs, outs, slots, want = case(dtype, token_slots)
    x, y, A, slots = (t.to(device) for t in (x, y, A, slots))
    Bs = [b.to(device) for b in Bs]
    lora_add(x, y, A, Bs, outs, slots)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.cpu().float(), want, atol=atol, rtol=rtol)


def test_lora_add_refuses_shapes_that_do_not_fit():
    x, y, A, Bs, outs, slots, _ = case(torch.float32, [0, 1])
    with pytest.raises(ValueError, match="do not fit together"):
        lora_add(x, y, A, Bs[:2], outs, slots)
