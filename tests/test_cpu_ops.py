"""The fused C++ CPU ops against their torch versions, and the paged decode attention against a
float32 reference. The C++ ops round where torch rounds, so in bfloat16 they agree bit for bit
except where a float32 last-bit difference (summation order, exp) crosses a bf16 rounding edge."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from radixserve.kernels import cpu_ops

torch.set_num_threads(1)

native = cpu_ops.native_ops()
needs_native = pytest.mark.skipif(native is None, reason="C++ extension not built (no compiler)")
DTYPES = [torch.bfloat16, torch.float32]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        assert (a != b).float().mean() < 2e-3  # almost all bit-equal
        torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=2**-6)  # the rest an ulp or two off
    else:
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")
def test_extension_builds_where_a_compiler_exists():
    assert native is not None


def test_a_build_killed_midway_does_not_block_the_next_start(tmp_path):
    """torch's lock file in the build directory, left by a build that was killed, is removed by
    the next start, which holds the kernel-held lock; a second process waits on that one."""
    import fcntl
    import subprocess
    import sys

    (tmp_path / "lock").write_text("")
    with cpu_ops._exclusive(tmp_path):
        assert not (tmp_path / "lock").exists()
        probe = "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)"
        held = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / "radixserve.lock")], capture_output=True
        )
        assert held.returncode != 0 and b"BlockingIOError" in held.stderr
    with open(tmp_path / "radixserve.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_fused_add(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    _close(native.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_torch(x, w, 1e-5), dtype)
    h_native, h_torch = x.clone(), x.clone()
    out_native = native.add_rms_norm_(h_native, delta, w, 1e-5)
    h_torch.add_(delta)
    _close(h_native, h_torch, dtype)  # the residual update itself is exact
    _close(out_native, cpu_ops.rms_norm_torch(h_torch, w, 1e-5), dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view(dtype):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 9 + 3 + 3, 64, generator=gen).to(dtype)
    angles = torch.rand(5, 32, generator=gen) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ours, ref = qkv.clone(), qkv.clone()
    native.rotary_(ours[:, :12], cos, sin)
    cpu_ops.rotary_torch_(ref[:, :12], cos, sin)
    _close(ours, ref, dtype)
    assert torch.equal(ours[:, 12:], qkv[:, 12:])  # v heads untouched


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_mul(dtype, rows):
    x = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    _close(native.silu_mul(x), cpu_ops.silu_mul_torch(x), dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 700])
def test_store_kv_writes_the_rows_index_copy_writes(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 9 + 3 + 3, 64, generator=gen).to(dtype)  # the fused output's view
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.randperm(2000, generator=gen)[:tokens] + 1
    ours = [torch.zeros(2001, 3, 64, dtype=dtype) for _ in range(2)]
    ref = [t.clone() for t in ours]
    assert cpu_ops.store_kv_(k, v, ours[0], ours[1], slots)
    ref[0].index_copy_(0, slots, k)
    ref[1].index_copy_(0, slots, v)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    # A slot past the pool is refused before anything is written; so is a non-adjacent head layout.
    with pytest.raises(RuntimeError, match="slot out of range"):
        native.store_kv_(k, v, ours[0], ours[1], torch.full_like(slots, 2001))
    assert not cpu_ops.store_kv_(qkv[:, 9:15:2], v, ours[0], ours[1], slots)


def _reference_decode(q, k_buf, v_buf, kv_indices, seq_lens):
    group = q.shape[1] // k_buf.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, n in enumerate(seq_lens.tolist()):
        slots = kv_indices[b, :n]
        keys = k_buf[slots].float().repeat_interleave(group, 1)  # [L, H, D]
        values = v_buf[slots].float().repeat_interleave(group, 1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[b].float(), keys) / math.sqrt(q.shape[-1]), -1)
        out[b] = torch.einsum("hl,lhd->hd", weights, values)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (32, 4, 4)])
@pytest.mark.parametrize("impl", ["native", "torch"])
def test_decode_attention(dtype, head_dim, heads, kv_heads, impl):
    if impl == "native" and native is None:
        pytest.skip("C++ extension not built")
    gen = torch.Generator().manual_seed(head_dim)
    k_buf = torch.randn(400, kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(400, kv_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([1, 37, 90, 5])
    kv_indices = torch.randperm(400, generator=gen)[: 4 * 90].view(4, 90).contiguous()
    q = torch.randn(4, heads + kv_heads, head_dim, generator=gen).to(dtype)[:, :heads]  # strided, like qkv
    if impl == "native":
        ours = native.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, 1 / math.sqrt(head_dim))
    else:
        ours = cpu_ops.decode_attention_torch(q, k_buf, v_buf, kv_indices, seq_lens)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        ours.float(), _reference_decode(q, k_buf, v_buf, kv_indices, seq_lens), atol=tol, rtol=tol
    )


@pytest.mark.skipif(native is None, reason="C++ extension not built")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,groups", [(8, 4), (13, 3), (40, 2), (3, 1)])
def test_decode_attention_runs_each_sequence_once_when_prefixes_are_shared(dtype, batch, groups):
    """Sequences on one cached prefix run one after another, two at a time where they share enough
    keys (csrc/attention.h `decode_units`, decode_avx512.h `decode_pair_avx512`): each sequence's
    output is the bits it gets alone, and the reference within tolerance."""
    gen = torch.Generator().manual_seed(batch)
    shared, own = 50, 30
    k_buf = torch.randn(groups * shared + batch * own + 1, 3, 64, generator=gen).to(dtype)
    v_buf = torch.randn(k_buf.shape, generator=gen).to(dtype)
    rows = [
        list(range(g * shared, (g + 1) * shared))
        + list(range(groups * shared + b * own, groups * shared + (b + 1) * own))
        for b in range(batch)
        for g in [b % groups]
    ]
    kv_indices = torch.tensor(rows)
    seq_lens = torch.randint(shared + 1, shared + own + 1, (batch,), generator=gen)
    if batch > 3:
        seq_lens[0] = 0  # a padded row: no keys
        seq_lens[1] = shared  # all of it the group's prefix
        seq_lens[1 + groups] = shared - 7  # a part of it (the same group as the row before)
    q = torch.randn(batch, 12, 64, generator=gen).to(dtype)[:, :9]
    scale = 1 / math.sqrt(64)
    ours = native.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, scale)
    for b in range(batch):
        if seq_lens[b]:
            alone = native.decode_attention(
                q[b : b + 1], k_buf, v_buf, kv_indices[b : b + 1], seq_lens[b : b + 1], scale
            )
            assert torch.equal(ours[b], alone[0]), b
    live = seq_lens > 0
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        ours[live].float(),
        _reference_decode(q[live], k_buf, v_buf, kv_indices[live], seq_lens[live]),
        atol=tol,
        rtol=tol,
    )


def _reference_extend(q, k_buf, v_buf, kv_indices, seq_lens, cu):
    """Causal attention of each sequence's new tokens over its slots, float32."""
    group = q.shape[1] // k_buf.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = cu[b].item(), cu[b + 1].item()
        slots = kv_indices[b, :n]
        keys = k_buf[slots].float().repeat_interleave(group, 1)
        values = v_buf[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("thd,lhd->htl", q[lo:hi].float(), keys) / math.sqrt(q.shape[-1])
        positions = n - (hi - lo) + torch.arange(hi - lo)
        scores = scores.masked_fill(torch.arange(n)[None, :] > positions[:, None], float("-inf"))
        out[lo:hi] = torch.einsum("htl,lhd->thd", scores.softmax(-1), values)
    return out


@needs_native
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2)])
def test_extend_attention_with_bf16_products(head_dim, heads, kv_heads):
    """New tokens after cached prefixes of every length class (none, inside the first key block,
    many blocks), query blocks of 32 tokens and a partial one, a lone token: as close to the float32
    reference as the float32 kernel is, both rounded to bf16 at the end."""
    if not native.extend_bf16_available():
        pytest.skip("no AVX512-BF16 on this CPU")
    gen = torch.Generator().manual_seed(head_dim)
    new, prefix = [5, 70, 1, 33], [0, 37, 100, 700]
    lens = [a + b for a, b in zip(new, prefix)]
    k_buf = torch.randn(3000, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_buf = torch.randn(3000, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    kv_indices = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    slots = (torch.randperm(2999, generator=gen) + 1).tolist()
    for b, n in enumerate(lens):
        kv_indices[b, :n] = torch.tensor(slots[:n])
        slots = slots[n:]
    seq_lens, cu = torch.tensor(lens), torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    qkv = torch.randn(sum(new), heads + 2 * kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, :heads]  # strided, like the fused projection's output
    ref = _reference_extend(q, k_buf, v_buf, kv_indices, seq_lens, cu)
    args = (q, k_buf, v_buf, kv_indices, seq_lens, cu)
    fast = cpu_ops.extend_attention_native(*args, bf16_products=True).float()
    exact = cpu_ops.extend_attention_native(*args).float()
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)
    assert (fast - ref).abs().mean() < 1.5 * (exact - ref).abs().mean() + 1e-4
    assert not torch.equal(fast, exact)  # the bf16 path ran, not the float32 kernel


@needs_native
def test_kernels_release_the_gil():
    """The engine overlaps Python work with the forward on another thread: a kernel must not
    hold the GIL while it runs."""
    import threading

    n = 1024
    k_buf = torch.randn(n + 1, 1, 64).to(torch.bfloat16)
    q = torch.randn(n, 4, 64).to(torch.bfloat16)
    ticks, stop = [0], [False]

    def spin():
        while not stop[0]:
            ticks[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    during = []
    try:
        for _ in range(3):
            before = ticks[0]  # read while this thread holds the GIL
            native.extend_attention(
                q,
                k_buf,
                k_buf,
                torch.arange(1, n + 1).view(1, -1),
                torch.tensor([n]),
                torch.tensor([0, n]),
                0.125,
            )
            during.append(ticks[0] - before)
    finally:
        stop[0] = True
        thread.join()
    assert max(during) > 1000


needs_gemm = pytest.mark.skipif(
    not cpu_ops.gemm_available(torch.bfloat16), reason="no AVX512-BF16 packed GEMM here"
)


def test_pack_linear_weight_round_trips_and_pads_to_whole_strips():
    w = torch.arange(37 * 6, dtype=torch.float32).view(37, 6).to(torch.bfloat16)
    wp = cpu_ops.pack_linear_weight(w)
    assert wp.shape == (3, 3, 16, 2)
    assert torch.equal(wp[0, 1, 2], w[2, 2:4])  # strip 0, k pair 1, column 2
    assert torch.equal(wp[2, 0, 4], w[36, 0:2])
    assert not wp[2, :, 5:].any()  # columns 37..47 are zero padding
    assert torch.equal(cpu_ops.unpack_linear_weight(wp, 37), w)
    with pytest.raises(ValueError, match="even"):
        cpu_ops.pack_linear_weight(torch.zeros(4, 5, dtype=torch.bfloat16))


@needs_gemm
@pytest.mark.parametrize(
    "m,k,n", [(1, 576, 960), (3, 64, 37), (16, 1536, 576), (17, 96, 48), (300, 128, 50), (0, 64, 16)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_float32_math_rounded_once(m, k, n, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen) if with_bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), bias).to(torch.bfloat16)
    wp = cpu_ops.pack_linear_weight(w)
    out = native.packed_linear(x, wp, n, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    if m:
        _close(out, ref, torch.bfloat16)  # only the float32 summation order differs
        # The torch fallback (no extension, or other dtypes) computes the same.
        _close(cpu_ops.packed_linear(x.float(), wp, n, bias).to(torch.bfloat16), ref, torch.bfloat16)


@needs_gemm
@pytest.mark.parametrize("m,n", [(75, 80), (71, 50), (300, 48), (40, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_gives_a_prefill_row_the_bits_of_its_row_tile_alone(m, n, with_bias):
    """Prefill-sized inputs run two strips at a time, decode-sized ones one: each 16-row tile (the
    last one shorter) must come out as it does when it is the whole input."""
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen) if with_bias else None
    wp = cpu_ops.pack_linear_weight(w)
    out = native.packed_linear(x, wp, n, bias)
    for r in range(0, m, 16):
        assert torch.equal(out[r : r + 16], native.packed_linear(x[r : r + 16], wp, n, bias)), r


@needs_gemm
def test_packed_linear_reads_strided_rows_and_rejects_a_wrong_k():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 200, generator=gen).to(torch.bfloat16)
    x = wide[:, :64]  # rows 200 elements apart
    w = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    wp = cpu_ops.pack_linear_weight(w)
    _close(native.packed_linear(x, wp, 32, None), torch.nn.functional.linear(x, w), torch.bfloat16)
    with pytest.raises(RuntimeError, match="K"):
        native.packed_linear(torch.zeros(2, 66, dtype=torch.bfloat16), wp, 32, None)
