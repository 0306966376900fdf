"""Deterministic mode (EngineConfig.deterministic): batch-invariant kernels, so that a seeded
request gives bitwise the same tokens whatever else runs; and what the default mode promises.

Kernel tests check the invariances one op at a time (a row of the fixed-order GEMM does not depend
on M; attention gives a token the same output in any chunk, batch or phase); engine tests check the
promise end to end on the default model (bf16) with seeded temperature-1 sampling.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from radixserve.cluster.config import parse_cli
from radixserve.kernels import cpu_ops
from radixserve.workers import Engine
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.models.attention import CpuBackend, TorchBackend, get_backend
from radixserve.workers.protocol import GenerateRequest, SamplingParams
from radixserve.workers.sampling.sampler import Sampler, SamplerRow, seeded_uniform
from tests.engine_utils import assert_kv_invariant
from tests.tiny_models import make_tiny_checkpoint

needs_native = pytest.mark.skipif(cpu_ops.native_ops() is None, reason="the CPU extension is not built")
needs_gemm = pytest.mark.skipif(
    not cpu_ops.gemm_available(torch.bfloat16), reason="the fixed-order GEMM needs a CPU with AVX512-BF16"
)

# About 70 tokens: several attention key blocks (32) and several prefill chunks of 16.
PROMPT = (
    "Write a short story about a robot who learns to paint. The robot lives in a small town by the "
    "sea, where every morning the fishermen bring their boats back to the harbour and the gulls "
    "circle over the market. Once upon a time"
)
OTHERS = [
    "Hi",
    "List three colors:",
    "Tell me about the history of the Roman empire in some detail, with dates and the names of the "
    "emperors, from Augustus to the fall of the western empire, and what the people in the provinces "
    "thought of it all, please.",
]
SEEDED = {"temperature": 1.0, "seed": 42, "max_new_tokens": 16, "ignore_eos": True}
# Sampled too (unseeded), of other lengths, so that the batch changes shape while PROMPT decodes.
OTHER_PARAMS = [{"temperature": 0.8, "max_new_tokens": n, "ignore_eos": True} for n in (5, 24, 11)]


# ---------------------------------------------------------------------------------------------- kernels


@needs_gemm
def test_fixed_order_gemm_row_is_independent_of_m():
    g = torch.Generator().manual_seed(0)
    k, n = 576, 200  # n not a multiple of the 16-column strip: a masked last strip
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    wp = cpu_ops.pack_linear_weight(w)
    bias = torch.randn(n, generator=g)
    x = torch.randn(300, k, generator=g).to(torch.bfloat16)
    alone = torch.cat(
        [cpu_ops.packed_linear(x[i : i + 1], wp, n, bias, fixed_order=True) for i in range(300)]
    )
    for m in (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 33, 128, 129, 300):
        assert torch.equal(cpu_ops.packed_linear(x[:m], wp, n, bias, fixed_order=True), alone[:m]), m
    # Within bf16 rounding of the exact product.
    exact = x.float() @ w.float().T + bias
    assert torch.allclose(alone.float(), exact, rtol=1e-2, atol=0.1)
    # The AVX512-BF16 variant (what runs where there is no AMX) is row-invariant too.
    chains = cpu_ops.native_ops().packed_linear_fixed_chains
    chains_alone = torch.cat([chains(x[i : i + 1], wp, n, bias) for i in range(300)])
    for m in (1, 3, 4, 5, 16, 17, 129, 300):
        assert torch.equal(chains(x[:m], wp, n, bias), chains_alone[:m]), m
    assert torch.allclose(chains_alone.float(), exact, rtol=1e-2, atol=0.1)
    # The default variant's order follows the row tile: these inputs do see the difference.
    default_alone = torch.cat([cpu_ops.packed_linear(x[i : i + 1], wp, n, bias) for i in range(300)])
    assert not torch.equal(cpu_ops.packed_linear(x, wp, n, bias), default_alone)


def _extend(q, k_buf, v_buf, slots, prefix: int, n: int) -> torch.Tensor:
    """Attention of the n tokens after `prefix` cached ones (one sequence)."""
    out = cpu_ops.extend_attention_native(
        q,
        k_buf,
        v_buf,
        slots[: prefix + n].unsqueeze(0),
        torch.tensor([prefix + n]),
        torch.tensor([0, n]),
    )
    assert out is not None
    return out


@needs_native
def test_attention_gives_a_token_one_output_in_any_chunk_batch_or_phase():
    g = torch.Generator().manual_seed(1)
    dim, kv_heads, heads, length = 64, 3, 9, 150
    k_buf = torch.randn(1024, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_buf = torch.randn(1024, kv_heads, dim, generator=g).to(torch.bfloat16)
    slots = torch.randperm(1024, generator=g)[:length]
    q = torch.randn(length, heads, dim, generator=g).to(torch.bfloat16)
    whole = _extend(q, k_buf, v_buf, slots, 0, length)
    for chunk in (1, 7, 16, 32, 50):
        parts = [
            _extend(q[s : s + chunk], k_buf, v_buf, slots, s, min(chunk, length - s))
            for s in range(0, length, chunk)
        ]
        assert torch.equal(torch.cat(parts), whole), chunk
    # Decode beside sequences of other lengths: each row is what extend gave its token.
    positions = [149, 0, 31, 32, 100]
    others = torch.stack([torch.randperm(1024, generator=g)[:length] for _ in positions])
    others[0] = slots
    kv_indices = others.contiguous()
    queries = torch.stack(
        [q[149], *torch.randn(len(positions) - 1, heads, dim, generator=g).to(torch.bfloat16)]
    )
    lens = torch.tensor([p + 1 for p in positions])
    batched = cpu_ops.decode_attention(queries, k_buf, v_buf, kv_indices, lens, fixed_order=True)
    assert torch.equal(batched[0], whole[149])
    for pos in (0, 1, 31, 32, 33, 149):
        alone = cpu_ops.decode_attention(
            q[pos : pos + 1],
            k_buf,
            v_buf,
            slots[: pos + 1].unsqueeze(0),
            torch.tensor([pos + 1]),
            fixed_order=True,
        )
        assert torch.equal(alone[0], whole[pos]), pos
    # ... and is softmax attention: the float32 reference within bf16 rounding.
    keys = k_buf[slots].float().repeat_interleave(3, dim=1)
    values = v_buf[slots].float().repeat_interleave(3, dim=1)
    scores = torch.einsum("hd,lhd->hl", q[149].float(), keys) / math.sqrt(dim)
    expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    assert torch.allclose(batched[0].float(), expected, atol=2e-2)


@needs_native
def test_batch_invariant_backend_is_cpu_only():
    backend = get_backend("auto", "cpu", 64, batch_invariant=True)
    assert isinstance(backend, CpuBackend) and backend.batch_invariant
    assert isinstance(get_backend("torch", "cpu", 64), TorchBackend)
    with pytest.raises(ValueError, match="deterministic mode runs the cpu attention backend on CPU only"):
        get_backend("torch", "cpu", 64, batch_invariant=True)


# ---------------------------------------------------------------------------------------------- sampler


def test_seeded_row_draws_alike_in_any_row_of_any_batch():
    """Given the same logits row, a seeded row's token depends only on its seed and step: not on its
    row index, the other rows or their parameters (top-k, top-p, min-p, greedy, unseeded)."""
    vocab = 49152
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, vocab, generator=g) * 3
    logits[:, 100:108] = 6.0  # ties at the top
    sampler = Sampler(vocab, [2])
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.0, min_p=0.05, seed=3),
        SamplingParams(temperature=1.3),
    ]

    def steps(row: int, batch: int) -> list[int]:
        gen = sampler.make_generator(7)
        out = []
        for step in range(4):
            rows = [SamplerRow(others[j % len(others)], [1], []) for j in range(batch)]
            rows[row] = SamplerRow(mine, [1], [], gen)
            x = logits[:batch].roll(step, 0).clone()
            x[row] = logits[step]
            out.append(sampler.sample(x, sampler.prepare(rows)).token_ids[row])
        return out

    alone = steps(0, 1)
    assert len(set(alone)) > 1  # it does sample
    for row, batch in ((0, 5), (3, 5), (11, 12)):
        assert steps(row, batch) == alone, (row, batch)


# ---------------------------------------------------------------------------------------------- config


def test_deterministic_refuses_what_it_cannot_keep():
    assert EngineConfig(deterministic=True).deterministic
    with pytest.raises(ValueError, match="tp_size 1"):
        EngineConfig(deterministic=True, tp_size=2)
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(deterministic=True, device="cuda")
    with pytest.raises(ValueError, match="cpu attention backend"):
        EngineConfig(deterministic=True, attention_backend="torch")
    assert parse_cli(["--deterministic"]).role_engine("unified").deterministic
    assert not parse_cli([]).role_engine("unified").deterministic


@needs_gemm
def test_deterministic_refuses_float32(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="deterministic mode needs the fixed-order bf16 GEMM"):
        Engine(path, deterministic=True, dtype="float32", max_total_tokens=1024)


# ---------------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def det():
    if not cpu_ops.gemm_available(torch.bfloat16):
        pytest.skip("deterministic mode needs a CPU with AVX512-BF16")
    e = Engine(deterministic=True, max_total_tokens=4096)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def det_chunked():
    if not cpu_ops.gemm_available(torch.bfloat16):
        pytest.skip("deterministic mode needs a CPU with AVX512-BF16")
    e = Engine(deterministic=True, max_total_tokens=4096, chunked_prefill_size=16)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def det_mixed():
    if not cpu_ops.gemm_available(torch.bfloat16):
        pytest.skip("deterministic mode needs a CPU with AVX512-BF16")
    e = Engine(deterministic=True, max_total_tokens=4096, chunked_prefill_size=16, enable_mixed_chunk=True)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def default():
    e = Engine(max_total_tokens=4096)
    yield e
    e.shutdown()


@pytest.fixture(autouse=True)
def invariant(request):
    yield
    for name in ("det", "det_chunked", "det_mixed", "default"):
        if name in request.fixturenames:
            assert_kv_invariant(request.getfixturevalue(name))


def _ids(out) -> list[int]:
    return out["output_ids"]


@pytest.fixture(scope="module")
def reference(det) -> list[int]:
    """PROMPT's seeded tokens, alone on the deterministic engine, from a cold cache."""
    det.flush_cache()
    out = _ids(det.generate(PROMPT, SEEDED))
    assert len(set(out)) > 3  # sampled text, not a loop of one token
    return out


def test_alone_vs_beside_concurrent_requests(det, reference):
    det.flush_cache()
    outs = det.generate([PROMPT, *OTHERS], [SEEDED, *OTHER_PARAMS])
    assert _ids(outs[0]) == reference
    assert [len(_ids(o)) for o in outs[1:]] == [5, 24, 11]
    # Beside the others again, with PROMPT now cached (its last token alone in a prefill chunk).
    assert _ids(det.generate([*OTHERS, PROMPT], [*OTHER_PARAMS, SEEDED])[3]) == reference


def test_n3_choice_0_is_the_n1_request(det, reference):
    det.flush_cache()
    outs = det.generate(PROMPT, dict(SEEDED, n=3))
    assert _ids(outs[0]) == reference
    # Sibling i draws from seed + i: choice 1 is the request seeded 43.
    det.flush_cache()
    assert _ids(outs[1]) == _ids(det.generate(PROMPT, dict(SEEDED, seed=43)))


def test_cache_hit_vs_cold(det, reference):
    det.flush_cache()
    det.generate(PROMPT, SEEDED)
    hit = det.generate(PROMPT, SEEDED)
    assert hit["meta_info"]["cached_tokens"] > 0
    assert _ids(hit) == reference
    # A partial hit: the first half of the prompt cached by another request.
    det.flush_cache()
    det.generate(PROMPT[: len(PROMPT) // 2], {"max_new_tokens": 2})
    partial = det.generate(PROMPT, SEEDED)
    assert 0 < partial["meta_info"]["cached_tokens"] < len(det.tokenizer.encode(PROMPT)) - 1
    assert _ids(partial) == reference


def test_chunk_size_does_not_matter(det_chunked, reference):
    det_chunked.flush_cache()
    out = det_chunked.generate(PROMPT, SEEDED)
    assert _ids(out) == reference
    assert _ids(det_chunked.generate([PROMPT, *OTHERS], [SEEDED, *OTHER_PARAMS])[0]) == reference


def test_mixed_steps_do_not_matter(det_mixed, reference):
    """Decodes that ride in a prefill step (extend arithmetic, beside other sequences' chunks)
    give the tokens they give in decode steps of their own."""
    det_mixed.flush_cache()
    before = det_mixed.stats()["mixed_steps_total"]
    outs = det_mixed.generate([*OTHERS, PROMPT], [*OTHER_PARAMS, SEEDED])
    assert det_mixed.stats()["mixed_steps_total"] > before
    assert _ids(outs[3]) == reference
    assert [len(_ids(o)) for o in outs[:3]] == [5, 24, 11]


def test_decoded_token_equals_its_recomputation(det):
    """A token's logits are the same decoded or recomputed by a prefill (as after a retraction, or
    when a later turn extends a cached conversation): logprobs agree bitwise."""
    params = dict(SEEDED, logprobs=True, top_logprobs=5, max_new_tokens=6)
    det.flush_cache()
    first = det.generate(PROMPT, params)
    prompt_ids = det.tokenizer.encode(PROMPT)
    for k in (2, 5):
        det.flush_cache()
        again = det.generate(
            input_ids=prompt_ids + _ids(first)[:k],
            sampling_params=dict(params, max_new_tokens=1, temperature=0.0),
        )
        assert again["meta_info"]["output_top_logprobs"][0] == first["meta_info"]["output_top_logprobs"][k]


def test_a_resumed_request_goes_on_as_the_uninterrupted_one(det, reference):
    """PD's recompute (or any replica continuing from the tokens a client has): the rest of a seeded
    request is what the uninterrupted request generated, its prefix recomputed by a prefill."""
    det.flush_cache()
    for k in (1, 6):
        req = GenerateRequest(
            det.tokenizer.encode(PROMPT), SamplingParams.from_dict(SEEDED), output_prefix=[reference[:k]]
        )
        (out,) = asyncio.run(det._collect(req))
        assert out["output_ids"] == reference[k:]


# ---------------------------------------------------------------------------------------------- default mode


def test_default_mode_same_request_alone_same_state(default):
    """The default mode's promise: the same request alone on an engine in the same state gives the
    same tokens (cold each time after a flush; or warm each time, once its prompt is cached)."""
    default.flush_cache()
    cold = _ids(default.generate(PROMPT, SEEDED))
    default.flush_cache()
    assert _ids(default.generate(PROMPT, SEEDED)) == cold
    warm = _ids(default.generate(PROMPT, SEEDED))
    assert _ids(default.generate(PROMPT, SEEDED)) == warm


def test_sequence_i_draws_from_seed_plus_i(default):
    """In either mode a seeded sequence carries its own generator, seeded seed + i for choice i: its
    draws never depend on its row, its siblings or the other requests."""
    reqs = default.core.make_reqs(
        GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(seed=42, n=3))
    )
    for i, req in enumerate(reqs):
        assert torch.equal(req.generator.get_state(), torch.Generator().manual_seed(42 + i).get_state())


def test_seeded_uniform_is_a_pure_function_of_seed_and_position():
    assert seeded_uniform(42, 3) == seeded_uniform(42, 3)
    # Every bit of the seed counts (torch's CPU generator keeps only the low 32).
    assert seeded_uniform(5, 0) != seeded_uniform(5 + 2**32, 0)
    assert seeded_uniform(-1, 0) == seeded_uniform(2**64 - 1, 0)  # manual_seed's own wrap-around
    draws = [seeded_uniform(seed, pos) for seed in range(100) for pos in range(100)]
    assert len(set(draws)) > 9990 and all(0.0 <= u < 1.0 for u in draws)
    counts = [0] * 10
    for u in draws:
        counts[int(u * 10)] += 1
    assert all(900 < c < 1100 for c in counts), counts


def test_a_seeded_row_draws_for_its_position():
    """The number for position k does not depend on who drew positions 0..k-1: a sequence that
    continues elsewhere (PD's decode side) or after a recompute draws what it would have."""
    vocab = 1000
    sampler = Sampler(vocab, [2])
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=11)
    straight, out = [], []
    gen = sampler.make_generator(11)
    for _ in range(6):
        straight.append(
            sampler.sample(logits, sampler.prepare([SamplerRow(params, [1], out, gen)])).token_ids[0]
        )
        out = out + [straight[-1]]
    fresh = sampler.make_generator(11)  # a new generator, as on another replica
    later = sampler.sample(logits, sampler.prepare([SamplerRow(params, [1], straight[:4], fresh)])).token_ids[
        0
    ]
    assert later == straight[4]
    assert len(set(straight)) > 1


def test_default_mode_logits_agree_within_bf16_across_batches(default):
    """The default mode's promise across batch compositions: the logits agree within bf16 rounding
    (so greedy output agrees as far as the dtype allows), not bitwise."""
    params = {"max_new_tokens": 1, "temperature": 0.0, "logprobs": True, "top_logprobs": 5}
    default.flush_cache()
    alone = default.generate(PROMPT, params)["meta_info"]["output_top_logprobs"][0]
    default.flush_cache()
    beside = default.generate([*OTHERS, PROMPT], [params] * 4)[3]["meta_info"]["output_top_logprobs"][0]
    assert [t for _, t, _ in alone[:2]] == [t for _, t, _ in beside[:2]]
    by_token = {t: lp for lp, t, _ in beside}
    # bf16 logits of magnitude 16-32 are 0.125 apart: a logprob moves by up to about two steps.
    assert all(abs(lp - by_token[t]) < 0.25 for lp, t, _ in alone if t in by_token)
