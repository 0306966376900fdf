"""Sampler: exact logits processing, filters that never leak, reproducible seeded draws."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.workers.protocol import SamplingParams
from radixserve.workers.sampling.sampler import MIN_LOGPROB, Sampler, SamplerRow

torch.set_num_threads(2)

V = 70  # tokenizer vocab; logits are padded to PADDED columns like a real model's
PADDED = 96
EOS = 7
_NEG = float("-inf")


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(vocab_size=V, eos_token_ids=[EOS], seed=seed)


def row(prompt=(), output=(), generator=None, **params) -> SamplerRow:
    return SamplerRow(SamplingParams(**params), list(prompt), list(output), generator)


def padded(logits: torch.Tensor) -> torch.Tensor:
    """Append padding columns with huge logits: picking one would be a bug."""
    return torch.cat([logits, torch.full((logits.shape[0], PADDED - V), 1e4)], dim=1)


def logits_from_probs(probs: list[float], rows: int = 1) -> torch.Tensor:
    base = torch.full((V,), -1e9)
    base[: len(probs)] = torch.tensor(probs).log()
    return padded(base.repeat(rows, 1))


def draws(params: dict, logits_row: torch.Tensor, n: int = 3000, seed: int = 0) -> list[int]:
    """n independent draws: one batch of n identical rows."""
    s = make_sampler(seed)
    batch = s.prepare([row(**params) for _ in range(n)])
    return s.sample(logits_row.expand(n, -1).contiguous(), batch).token_ids


def test_greedy_is_argmax_and_plain_fast_path():
    s = make_sampler()
    logits = padded(torch.randn(5, V, generator=torch.Generator().manual_seed(1)))
    batch = s.prepare([row(temperature=0.0) for _ in range(5)])
    assert batch.plain_greedy
    assert s.sample(logits, batch).token_ids == logits[:, :V].argmax(-1).tolist()


def test_top_k_one_is_greedy_even_at_high_temperature():
    s = make_sampler()
    logits = padded(torch.randn(4, V, generator=torch.Generator().manual_seed(2)))
    batch = s.prepare([row(temperature=5.0, top_k=1) for _ in range(4)])
    for _ in range(5):
        assert s.sample(logits, batch).token_ids == logits[:, :V].argmax(-1).tolist()


def seeded_run(
    sampler: Sampler, seed: int, others: list[SamplerRow], position: int, steps: int = 12
) -> list[int]:
    """Generate `steps` tokens for one seeded row sitting at `position` among `others`."""
    gen = sampler.make_generator(seed)
    logits_gen = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        mine = row(output=out, generator=gen, temperature=1.3, top_p=0.9, seed=seed)
        rows = others[:position] + [mine] + others[position:]
        logits = padded(torch.randn(len(rows), V, generator=logits_gen))
        logits[position] = padded(torch.arange(V, dtype=torch.float32)[None] / 10)[0]
        out.append(sampler.sample(logits, sampler.prepare(rows)).token_ids[position])
    return out


def test_seeded_rows_reproduce_regardless_of_batch():
    alone = seeded_run(make_sampler(0), 1234, [], 0)
    assert seeded_run(make_sampler(1), 1234, [], 0) == alone
    others = [
        row(temperature=0.7),
        row(temperature=0.0),
        row(temperature=1.0, top_k=5, seed=9, generator=torch.Generator().manual_seed(9)),
    ]
    assert seeded_run(make_sampler(2), 1234, others, 1) == alone
    assert seeded_run(make_sampler(3), 1234, others[:1], 1) == alone
    assert seeded_run(make_sampler(0), 4321, [], 0) != alone
    assert len(set(alone)) > 3  # it really sampled


def test_unseeded_sampling_follows_the_distribution():
    probs = [0.5, 0.3, 0.2]
    tokens = draws({"temperature": 1.0}, logits_from_probs(probs)[0], n=6000)
    freq = [tokens.count(t) / len(tokens) for t in range(3)]
    assert set(tokens) == {0, 1, 2}
    assert all(abs(f - p) < 0.03 for f, p in zip(freq, probs)), freq


@pytest.mark.parametrize(
    "params, allowed",
    [
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.65}, {0, 1}),  # the mass before token 2 is 0.7 >= 0.65
        ({"top_p": 0.8}, {0, 1, 2}),  # the mass before token 3 is 0.85
        ({"min_p": 0.2}, {0, 1, 2, 3}),  # drops p < 0.2 * 0.4
        ({"top_k": 4, "top_p": 0.8}, {0, 1, 2}),  # renormalised over 4: mass before token 3 is 0.89
        ({"top_k": 2, "top_p": 0.9}, {0, 1}),  # top_p alone would keep 4
        ({"top_k": 2, "min_p": 0.01}, {0, 1}),
    ],
)
def test_filters_never_pick_a_filtered_token(params, allowed):
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    logits = logits_from_probs(probs)[0]
    assert set(draws({"temperature": 1.0, **params}, logits)) == allowed


def test_min_p_is_relative_to_the_top_token_after_temperature():
    logits = logits_from_probs([0.4, 0.3, 0.15, 0.1, 0.05])[0]
    # At temperature 0.5 probabilities ~ p^2: 0.16 : 0.09 : 0.0225 : 0.01 ... ; 0.1 * 0.16 = 0.016.
    assert set(draws({"temperature": 0.5, "min_p": 0.1}, logits)) == {0, 1, 2}


def test_mixed_batch_rows_keep_their_own_filters():
    s = make_sampler()
    kinds = [row(temperature=0.0), row(top_k=2), row(temperature=1.0), row(top_p=0.5)]
    rows = kinds * 300  # interleaved, so every kind sits among the others
    logits = logits_from_probs([0.4, 0.3, 0.15, 0.1, 0.05], rows=len(rows))
    tokens = s.sample(logits, s.prepare(rows)).token_ids
    seen = [set(tokens[k :: len(kinds)]) for k in range(len(kinds))]
    assert seen == [{0}, {0, 1}, {0, 1, 2, 3, 4}, {0, 1}]


def test_penalties_change_logits_exactly():
    s = make_sampler()
    raw = torch.zeros(2, V)
    raw[:, :5] = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])
    rows = [
        row(prompt=[0, 4], output=[1, 1, 3], repetition_penalty=2.0),
        row(prompt=[0, 4], output=[1, 1, 3], frequency_penalty=0.5, presence_penalty=0.25),
    ]
    out = s.process_logits(padded(raw), s.prepare(rows))
    assert out.shape == (2, V)
    assert out[0, :6].tolist() == [1.0, -2.0, 0.5, 1.5, -8.0, 0.0]
    assert out[1, :6].tolist() == [2.0, -1.0 - 1.0 - 0.25, 0.5, 3.0 - 0.5 - 0.25, -4.0, 0.0]
    assert torch.equal(out[:, 6:], raw[:, 6:])


def test_penalty_order_bias_then_repetition_then_frequency():
    s = make_sampler()
    raw = torch.zeros(1, V)
    raw[0, 1] = -1.0
    # bias makes the logit positive, so the repetition penalty divides: (-1 + 3) / 2 - 0.5 * 2 - 0.5
    rows = [
        row(
            output=[1, 1],
            logit_bias={1: 3.0},
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.5,
        )
    ]
    assert s.process_logits(padded(raw), s.prepare(rows))[0, 1].item() == -0.5


def test_logit_bias_is_added_and_steers_greedy():
    s = make_sampler()
    raw = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    logits = padded(raw)
    batch = s.prepare([row(temperature=0.0, logit_bias={5: 100.0, 6: -2.5})])
    out = s.process_logits(logits, batch)
    assert out[0, 5] == raw[0, 5] + 100.0  # float32 arithmetic, exactly
    assert out[0, 6] == raw[0, 6] - 2.5
    assert torch.equal(out[0, :5], raw[0, :5])
    assert s.sample(logits, batch).token_ids == [5]
    assert torch.equal(logits[:, :V], raw)  # input untouched


def test_min_new_tokens_blocks_eos_and_stop_token_ids():
    s = make_sampler()
    raw = torch.zeros(1, V)
    raw[0, EOS], raw[0, 9], raw[0, 11] = 10.0, 9.0, 8.0
    logits = padded(raw)
    for produced, expected in [(0, 11), (1, 11), (2, EOS)]:
        rows = [row(output=[3] * produced, temperature=0.0, min_new_tokens=2, stop_token_ids=(9,))]
        assert s.sample(logits, s.prepare(rows)).token_ids == [expected]


def test_logprobs_come_from_the_raw_distribution_best_first():
    s = make_sampler()
    raw = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    rows = [
        row(temperature=0.0, logprobs=True, top_logprobs=5, logit_bias={2: 50.0}),
        row(temperature=0.0),
        row(temperature=1.0, logprobs=True),
    ]
    out = s.sample(padded(raw), s.prepare(rows))
    ref = raw.log_softmax(-1)
    assert out.token_ids[0] == 2
    assert out.logprobs[1] is None
    for i in (0, 2):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-6)
    top = out.logprobs[0].top
    expected_ids = ref[0].topk(5).indices.tolist()
    assert [t for t, _ in top] == expected_ids
    assert [v for _, v in top] == pytest.approx(ref[0, expected_ids].tolist(), abs=1e-6)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert out.logprobs[2].top == []


@pytest.mark.parametrize("candidates", [8, 64])
def test_top_p_candidates_equal_the_full_sort(candidates):
    from radixserve.workers.sampling.logit_filters import _by_sort, keep_top_k_top_p

    g = torch.Generator().manual_seed(6)
    # Peaked rows are settled by the candidates; flat ones (scale 0.1) need the fallback sort.
    s = torch.randn(8, 500, generator=g) * torch.tensor([4.0, 0.1] * 4)[:, None]
    k = torch.tensor([[500], [500], [5], [500], [3], [8], [500], [500]])
    p = torch.tensor([[0.9], [0.9], [0.5], [0.3], [0.99], [0.95], [0.6], [0.999]])
    expected = _by_sort(s, k, p)
    assert torch.equal(keep_top_k_top_p(s, k, p, candidates), expected)
    kept = (expected > _NEG).sum(-1)
    assert kept[1] > candidates and kept[0] < candidates  # both paths really ran


# Hostile logits and parameters: never an id outside the vocabulary, never a NaN choice -----------
def hostile_logits() -> torch.Tensor:
    """One row per case, padded with huge logits in the columns past the vocabulary."""
    base = torch.randn(7, V, generator=torch.Generator().manual_seed(8))
    base[0] = _NEG  # nothing allowed
    base[1] = float("nan")  # broken row
    base[2, 12] = float("inf")  # one +inf
    base[3, [12, 20]] = float("inf")  # two +inf: both stay candidates
    base[4, :] = -5.0
    base[4, [3, 9]] = float("nan")  # NaNs among finite logits: never picked
    base[4, 10] = 1.0
    base[5] = float("nan")
    base[5, 30] = 0.0  # the only number in a NaN row
    base[6] = _NEG
    base[6, 40] = float("inf")  # +inf among -inf
    return padded(base)


HOSTILE_GREEDY = [EOS, EOS, 12, 12, 10, 30, 40]  # all -inf or all NaN: the first EOS token


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.0, "repetition_penalty": 1.5}])
def test_greedy_on_hostile_logits(params):
    s = make_sampler()
    rows = [row(output=[5], **params) for _ in range(7)]
    assert s.sample(hostile_logits(), s.prepare(rows)).token_ids == HOSTILE_GREEDY


@pytest.mark.parametrize(
    "params", [{}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}, {"top_k": 3, "top_p": 0.8, "min_p": 0.2}]
)
def test_sampling_on_hostile_logits(params):
    s = make_sampler()
    n = 200
    logits = hostile_logits().repeat_interleave(n, 0)
    tokens = s.sample(logits, s.prepare([row(temperature=1.0, **params) for _ in range(7 * n)])).token_ids
    per_case = [set(tokens[i * n : (i + 1) * n]) for i in range(7)]
    assert per_case[0] == per_case[1] == {EOS}
    assert per_case[2] == {12}
    assert per_case[3] == {12, 20}  # both +inf tokens are equally likely
    assert per_case[4] <= set(range(V)) - {3, 9} and 10 in per_case[4]
    assert per_case[5] == {30}
    assert per_case[6] == {40}


def test_logprobs_of_hostile_rows_are_finite():
    s = make_sampler()
    rows = [row(temperature=0.0, logprobs=True, top_logprobs=3) for _ in range(7)]
    out = s.sample(hostile_logits(), s.prepare(rows))
    assert out.token_ids == HOSTILE_GREEDY
    values = [lp.logprob for lp in out.logprobs] + [v for lp in out.logprobs for _, v in lp.top]
    assert all(math.isfinite(v) and v >= MIN_LOGPROB for v in values)
    assert out.logprobs[2].logprob == 0.0  # the only +inf token has all the mass


@pytest.mark.parametrize("temperature", [1e-44, 1e-45, 5e-7])
def test_denormal_and_tiny_temperatures_are_greedy(temperature):
    s = make_sampler()
    logits = padded(torch.randn(4, V, generator=torch.Generator().manual_seed(9)) * 30)
    batch = s.prepare([row(temperature=temperature, top_p=0.9) for _ in range(4)])
    assert batch.sample_rows is None  # nothing is divided by the temperature
    assert s.sample(logits, batch).token_ids == logits[:, :V].argmax(-1).tolist()


def test_tiny_repetition_penalty_and_huge_temperature_stay_in_range():
    s = make_sampler()
    raw = torch.randn(2, V, generator=torch.Generator().manual_seed(10))
    raw[:, 4], raw[:, 6] = 2.0, -3.0
    raw[:, 50:] = _NEG  # masked: never drawn, whatever the temperature
    # A penalty of 1e-45 turns the repeated positive logit into +inf (the sampler copes; validation
    # refuses such values before they get here).
    rows = [
        row(output=[4, 6], temperature=0.0, repetition_penalty=1e-45),
        row(output=[4, 6], temperature=1.0, repetition_penalty=1e-45),
    ]
    assert s.sample(padded(raw), s.prepare(rows)).token_ids == [4, 4]
    n = 300
    tokens = s.sample(padded(raw[:1]).expand(n, -1), s.prepare([row(temperature=1e39)] * n)).token_ids
    assert set(tokens) <= set(range(50)) and len(set(tokens)) > 10


def test_a_row_with_every_token_blocked_falls_back_to_the_raw_argmax():
    s = make_sampler()
    raw = torch.full((1, V), _NEG)
    raw[0, EOS] = 3.0  # only EOS is possible, and min_new_tokens blocks it
    for params in ({"temperature": 0.0}, {"temperature": 1.0}):
        rows = [row(output=[], min_new_tokens=2, **params)]
        assert s.sample(padded(raw), s.prepare(rows)).token_ids == [EOS]
