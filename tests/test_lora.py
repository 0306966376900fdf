"""Multi-LoRA in the engine: each adapter's greedy output equals transformers with the adapter
merged (fp32, exact tokens), a batch mixing adapters equals the requests run one adapter at a
time, the cache is namespaced by adapter, adapters load and unload at run time, and what the
engine cannot serve is refused with its reason."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from radixserve.workers.engine.engine import Engine
from radixserve.workers.lora.adapter import LoRAError
from radixserve.workers.protocol import InvalidRequest
from tests.engine_utils import assert_kv_invariant
from tests.lora_utils import ALL_TARGETS, default_model_dir, hf_greedy, make_adapter, merged_hf
from tests.tiny_models import make_tiny_checkpoint

NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
# name -> (seed, rank, alpha, targets, extra LoraConfig fields)
SPECS = {
    "qv8": (1, 8, 16, ["q_proj", "v_proj"], {}),
    "all16": (2, 16, 8, ALL_TARGETS, {"use_rslora": True}),
    "mlp4": (3, 4, 8, ["gate_proj", "up_proj", "down_proj"], {}),
    "attn8": (4, 8, 32, ["q_proj", "k_proj", "v_proj", "o_proj"], {"alpha_pattern": {"o_proj": 4}}),
}


@pytest.fixture(scope="module")
def base_dir() -> str:
    return default_model_dir()


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(base_dir, str(root / name), seed, r, alpha, targets, std=0.1, **extra)
        for name, (seed, r, alpha, targets, extra) in SPECS.items()
    }


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):\n"),
        tok.encode("Once upon"),
    ]


def lora_engine(adapters: dict[str, str], **kwargs) -> Engine:
    paths = tuple(f"{n}={p}" for n, p in adapters.items())
    return Engine(dtype="float32", max_total_tokens=4096, lora_paths=paths, num_threads=2, **kwargs)


@pytest.fixture(scope="module")
def engine(adapters):
    eng = lora_engine(adapters, max_loras_per_batch=4)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def references(base_dir, adapters, prompts) -> dict[str | None, list[list[int]]]:
    out = {}
    for name in [None, *adapters]:
        hf = merged_hf(base_dir, None if name is None else adapters[name])
        out[name] = [hf_greedy(hf, p, NEW) for p in prompts]
    return out


def all_at_once(engine, cases, params=GREEDY) -> list[list[int]]:
    """Each (prompt, adapter) case's output ids, the cases submitted together (one batch)."""

    async def gather():
        return await asyncio.gather(
            *(engine.async_generate(input_ids=p, sampling_params=params, lora_path=lo) for p, lo in cases)
        )

    return [o["output_ids"] for o in asyncio.run(gather())]


def outputs(engine, prompts, lora):
    return [
        o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=lora)
    ]


def test_each_adapter_equals_transformers_with_it_merged(engine, prompts, references):
    assert len({json.dumps(r) for r in references.values()}) == len(references)  # each one matters
    for name, refs in references.items():
        assert outputs(engine, prompts, name) == refs, name
    assert_kv_invariant(engine)


def test_a_batch_mixing_four_adapters_and_the_base_equals_each_alone(engine, prompts, references):
    names = [None, *SPECS]
    cases = [(name, k) for name in names for k in range(len(prompts))]

    before = engine.stats()["step_steps"]
    results = all_at_once(engine, [(prompts[k], name) for name, k in cases])
    for (name, k), out in zip(cases, results):
        assert out == references[name][k], (name, k)
    # Batched: far fewer steps than the 15 requests' tokens one request at a time.
    assert engine.stats()["step_steps"] - before < 3 * NEW
    assert_kv_invariant(engine)


def test_adapters_over_the_default_models_own_gguf_blocks_equal_transformers_merged(
    adapters, prompts, references
):
    """The engine computes the base from the GGUF file's blocks: the adapters add their deltas to
    that output as to the dequantized one. float32 activations, as the reference's (on a CPU with
    AVX512-BF16 the default dtype would be bfloat16, whose greedy tokens may part from it)."""
    eng = Engine(
        dtype="float32",
        quantization="gguf",
        max_total_tokens=4096,
        lora_paths=(f"all16={adapters['all16']}",),
        max_loras_per_batch=1,
    )
    try:
        base = eng.core.runner.model.model.layers[0].mlp.down_proj
        assert base.quantized is not None and base.lora is not None
        assert outputs(eng, prompts, "all16") == references["all16"]
        assert_kv_invariant(eng)
    finally:
        eng.shutdown()


def test_the_cache_is_namespaced_by_adapter(engine):
    prompt = engine.tokenizer.encode("A long shared system prompt. " * 12)
    once = {"max_new_tokens": 2, "temperature": 0}

    def cached(lora):
        return engine.generate(input_ids=prompt, sampling_params=once, lora_path=lora)["meta_info"][
            "cached_tokens"
        ]

    assert cached("qv8") == 0
    assert cached("all16") == 0  # the same prompt under another adapter shares nothing
    assert cached(None) == 0  # nor with the base model
    assert cached("qv8") >= len(prompt) - 1 - engine.core.pool.page_size  # within one: all of it
    assert_kv_invariant(engine)


def test_load_and_unload_while_requests_run(engine, adapters, prompts, references, base_dir, tmp_path):
    late = make_adapter(base_dir, str(tmp_path / "late"), seed=9, r=8, alpha=16, targets=["o_proj"], std=0.1)
    late_refs = [hf_greedy(merged_hf(base_dir, late), p, NEW) for p in prompts]

    async def traffic():
        long = {**GREEDY, "max_new_tokens": 40}
        running = [
            asyncio.ensure_future(engine.async_generate(input_ids=p, sampling_params=long, lora_path="qv8"))
            for p in prompts
        ]
        await asyncio.sleep(0.2)
        await asyncio.to_thread(engine.load_lora_adapter, "late", late)
        got = await engine.async_generate(input_ids=prompts, sampling_params=GREEDY, lora_path="late")
        assert engine.unload_lora_adapter("qv8")
        done = await asyncio.gather(*running)  # those running keep their adapter to the end
        return got, done

    got, done = asyncio.run(traffic())
    assert [o["output_ids"] for o in got] == late_refs
    long_refs = [hf_greedy(merged_hf(base_dir, adapters["qv8"]), p, 40) for p in prompts]
    assert [o["output_ids"] for o in done] == long_refs
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'qv8'"):
        outputs(engine, prompts, "qv8")
    engine.load_lora_adapter("qv8", adapters["qv8"])
    assert outputs(engine, prompts, "qv8") == references["qv8"]
    assert set(engine.lora_adapters()) == {*SPECS, "late"}
    assert_kv_invariant(engine)


def test_what_cannot_be_served_is_refused_with_its_reason(engine, adapters, tmp_path, base_dir):
    def variant(name: str, edit_config=None, edit_tensors=None) -> str:
        src, dst = adapters["qv8"], tmp_path / name
        dst.mkdir()
        with open(os.path.join(src, "adapter_config.json")) as f:
            config = json.load(f)
        if edit_config:
            edit_config(config)
        (dst / "adapter_config.json").write_text(json.dumps(config))
        from safetensors.torch import load_file, save_file

        tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
        if edit_tensors:
            tensors = edit_tensors(tensors)
        save_file(tensors, str(dst / "adapter_model.safetensors"))
        return str(dst)

    def first_a(t):
        key = next(k for k in t if "lora_A" in k)
        return {**t, key: torch.zeros(t[key].shape[0], t[key].shape[1] + 1)}

    def over_rank(t):
        return {
            k: torch.zeros(64, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 64)
            for k, v in t.items()
        }

    cases = {
        variant("dora", lambda c: c.update(use_dora=True)): "DoRA",
        variant("bias", lambda c: c.update(bias="all")): "trained biases",
        variant("saves", lambda c: c.update(modules_to_save=["lm_head"])): "modules_to_save",
        variant("shape", edit_tensors=first_a): "do not fit the model",
        variant("rank", edit_tensors=over_rank): "over the maximum LoRA rank 16",
        variant(
            "embed",
            edit_tensors=lambda t: {
                **t,
                "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 4),
            },
        ): "may be adapted",
        str(tmp_path): "not a LoRA adapter directory",
    }
    for path, reason in cases.items():
        with pytest.raises(LoRAError, match=reason):
            engine.load_lora_adapter("bad", path)
    assert "bad" not in engine.lora_adapters()
    with pytest.raises(InvalidRequest, match="no LoRA adapter named"):
        outputs(engine, [[1, 2, 3]], "nope")


def test_more_adapters_than_slots_and_memory_all_answer_right(adapters, prompts, references):
    """Two batch slots, two adapters kept in memory, four adapters asked at once: requests wait
    for a slot, adapters are dropped and read again, and every answer is still its adapter's."""
    eng = lora_engine(adapters, max_loras_per_batch=2, max_loaded_loras=2)
    try:
        results = all_at_once(eng, [(p, name) for name in SPECS for p in prompts])
        for i, name in enumerate(SPECS):
            assert results[i * len(prompts) : (i + 1) * len(prompts)] == references[name], name
        assert eng.stats()["lora_adapters_in_memory"] <= 2 + 2  # in memory: at most 2 loaded + the 2 in slots
        assert_kv_invariant(eng)
    finally:
        eng.shutdown()


def test_pd_pools_serve_adapters_and_a_decode_replica_reads_one_it_was_not_given(tmp_path):
    """Both pools run the adapter (a tiny llama: the transfer is not what is tested); the decode
    replica serves no adapter by name and reads it from the directory the request names."""
    from radixserve.workers.protocol import GenerateRequest, LoRARef, SamplingParams
    from tests.test_pd_engine import pd_run

    path = make_tiny_checkpoint(tmp_path, "llama")
    adapter = make_adapter(path, str(tmp_path / "ad"), seed=6, r=4, alpha=8, targets=ALL_TARGETS, std=0.2)
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140))]
    refs = {
        name: [hf_greedy(merged_hf(path, adapter if name else None), p, 8) for p in prompts]
        for name in ["ad", None]
    }
    assert refs["ad"] != refs[None]
    args = dict(dtype="float32", max_total_tokens=1024, kv_transfer="gloo", kv_transfer_timeout_s=30.0)
    prefill = Engine(path, role="prefill", lora_paths=(f"ad={adapter}",), **args)
    decode = Engine(path, role="decode", enable_lora=True, **args)
    try:
        params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 8})
        for name in ["ad", None]:
            lora = LoRARef(name, adapter) if name else None
            for k, p in enumerate(prompts):
                req = GenerateRequest(list(p), params, lora=lora)
                assert asyncio.run(pd_run(prefill, decode, req))[0]["ids"] == refs[name][k], (name, k)
        assert decode.loaded_lora_adapters() == ["ad"] and decode.lora_adapters() == {}
        assert_kv_invariant(prefill)
        assert_kv_invariant(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_tiny_qwen3_with_an_adapter_equals_transformers_merged(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    adapter = make_adapter(path, str(tmp_path / "ad"), seed=5, r=4, alpha=8, targets=ALL_TARGETS, std=0.2)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 17)]
    refs = [hf_greedy(merged_hf(path, adapter), p, 8) for p in prompts]
    base = [hf_greedy(merged_hf(path, None), p, 8) for p in prompts]
    assert refs != base
    eng = Engine(model_path=path, dtype="float32", max_total_tokens=1024, lora_paths=(f"ad={adapter}",))
    try:
        params = {**GREEDY, "max_new_tokens": 8}
        out = eng.generate(input_ids=prompts, sampling_params=params, lora_path=["ad", None])
        assert [o["output_ids"] for o in out] == [refs[0], base[1]]
        assert_kv_invariant(eng)
    finally:
        eng.shutdown()


def test_tp2_shards_each_adapter_with_its_layers_and_fills_every_rank(tmp_path):
    """A tiny llama at tp_size 2 (one KV head per rank): q/k/v and gate/up adapters split by
    output rows, o and down by input columns, their partial deltas summed by the layer's own
    all-reduce; a batch mixing two adapters and the base, and one loaded at run time (filled on
    the other rank by rank 0's order), equal transformers with each adapter merged."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    made = {
        n: make_adapter(path, str(tmp_path / n), seed=seed, r=4, alpha=8, targets=ALL_TARGETS, std=0.2)
        for n, seed in [("a", 7), ("b", 8), ("c", 9)]
    }
    prompts = [[5, 6, 7, 8, 9], list(range(100, 130)), [42] * 7]
    refs = {
        n: [hf_greedy(merged_hf(path, made.get(n)), p, 8) for p in prompts] for n in ["a", "b", "c", None]
    }
    assert len({json.dumps(r) for r in refs.values()}) == 4
    eng = Engine(
        path,
        dtype="float32",
        max_total_tokens=1024,
        num_threads=1,
        tp_size=2,
        lora_paths=(f"a={made['a']}", f"b={made['b']}"),
        max_loras_per_batch=3,
    )
    try:
        params = {**GREEDY, "max_new_tokens": 8}
        cases = [(n, k) for n in ["a", "b", None] for k in range(len(prompts))]
        results = all_at_once(eng, [(prompts[k], n) for n, k in cases], params)
        for (n, k), out in zip(cases, results):
            assert out == refs[n][k], (n, k)
        eng.load_lora_adapter("c", made["c"])
        outs = eng.generate(input_ids=prompts, sampling_params=params, lora_path="c")
        assert [o["output_ids"] for o in outs] == refs["c"]
        assert_kv_invariant(eng)
    finally:
        eng.shutdown()


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="max_loaded_loras must be >= max_loras_per_batch"):
        Engine(dtype="float32", enable_lora=True, max_loras_per_batch=4, max_loaded_loras=2)
    with pytest.raises(ValueError, match="name=path"):
        Engine(dtype="float32", lora_paths=("=x",))
    eng = Engine(dtype="float32", max_total_tokens=512)
    try:
        with pytest.raises(InvalidRequest, match="runs no LoRA adapters"):
            eng.load_lora_adapter("a", "/nowhere")
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "slots, form",
    [
        ([2] * 40, "single"),  # one adapter for every token
        ([0] * 20 + [-1] * 20 + [1] * 24 + [0] * 16, "runs"),  # prefill chunks, the base's between
        ([0, 1, 2, -1, 1, 1, 3, 0, -1, 2], "gathered"),  # decode: one token per request
    ],
)
def test_the_three_batched_forms_equal_each_row_computed_alone(slots, form):
    from radixserve.workers.lora.adapter import ModuleLoRA
    from radixserve.workers.lora.layers import LoRABatch, LoRAContext, LoRAProjection
    from radixserve.workers.models.linear import FusedLinear

    gen = torch.Generator().manual_seed(0)
    linear = FusedLinear(24, [(0, 16), (0, 8), (0, 8)], False, torch.float64)
    ctx = LoRAContext()
    proj = LoRAProjection(linear, ctx, slots=4, rank=4, dtype=torch.float64, device="cpu")
    weights = {}
    for s, r in enumerate([4, 2, 3, 1]):  # ranks below the buffers' maximum are zero-padded
        parts = {
            p: (
                torch.randn(r, 24, generator=gen, dtype=torch.float64),
                torch.randn(o, r, generator=gen, dtype=torch.float64),
            )
            for p, o in [(0, 16), (2, 8)]
        }
        weights[s] = parts
        proj.set_slot(s, ModuleLoRA(parts))
    x = torch.randn(len(slots), 24, generator=gen, dtype=torch.float64)
    y = torch.randn(len(slots), 32, generator=gen, dtype=torch.float64)
    want = y.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            for p, (lo, hi) in [(0, (0, 16)), (2, (24, 32))]:
                a, b = weights[s][p]
                want[t, lo:hi] += (x[t] @ a.T) @ b.T
    ctx.batch = LoRABatch.of(slots, torch.float64, torch.device("cpu"))
    got = "single" if ctx.batch.single is not None else "runs" if ctx.batch.runs else "gathered"
    assert got == form
    proj.add_(x, y)
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_cpu_kernel_equals_the_gathered_torch_form(dtype):
    """The decode form on CPU runs kernels/csrc/lora.h where the extension is built: the deltas
    of the torch calls it replaces (rank padding, base rows, a part without weights), as exact
    or more so."""
    from radixserve.kernels import cpu_ops
    from radixserve.workers.lora.adapter import ModuleLoRA
    from radixserve.workers.lora.layers import LoRABatch, LoRAContext, LoRAProjection
    from radixserve.workers.models.linear import FusedLinear

    if cpu_ops.native_ops() is None:
        pytest.skip("C++ extension not built (no compiler)")
    gen = torch.Generator().manual_seed(1)
    linear = FusedLinear(64, [(0, 32), (0, 16), (0, 16)], False, dtype)
    ctx = LoRAContext()
    proj = LoRAProjection(linear, ctx, slots=4, rank=8, dtype=dtype, device="cpu")
    for s, r in enumerate([8, 4, 2, 8]):
        parts = {
            p: (torch.randn(r, 64, generator=gen), torch.randn(o, r, generator=gen))
            for p, o in [(0, 32), (1, 16)]
        }
        proj.set_slot(s, ModuleLoRA({p: (a.to(dtype), b.to(dtype)) for p, (a, b) in parts.items()}))
    slots = [0, 1, 2, -1, 1, 1, 3, 0, -1, 2]
    x = torch.randn(len(slots), 64, generator=gen).to(dtype)
    y0 = torch.randn(len(slots), 64, generator=gen).to(dtype)
    ctx.batch = LoRABatch.of(slots, dtype, torch.device("cpu"))
    assert ctx.batch.slots_cpu is not None
    fused = y0.clone()
    proj.add_(x, fused)
    ctx.batch.slots_cpu = None  # the torch calls of the same form
    plain = y0.clone()
    proj.add_(x, plain)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-5)
    else:  # bf16: the kernel keeps its sums in float32, the torch calls round each product
        exact = y0.double().clone()
        for t, s in enumerate(slots):
            if s >= 0:
                xa = x[t].double() @ proj.A[s].double().view(64, 3 * 8)
                for p, (lo, hi) in enumerate(proj.outs):
                    exact[t, lo:hi] += xa[p * 8 : (p + 1) * 8] @ proj.B[p][s].double()
        assert (fused.double() - exact).abs().max() <= (plain.double() - exact).abs().max() + 1e-3
    assert not torch.equal(fused, y0)
