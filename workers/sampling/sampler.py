"""Turns a batch of logits into next tokens.

Two steps: `Sampler.prepare(rows)` turns per-request parameters into tensors once per batch;
`Sampler.sample(logits, batch)` then runs on the device; the chosen ids are read back at the end.

Grammar masks are applied to the logits before they get here (constrained/grammar.py
`apply_bitmask`). Processing order, per row: logit_bias -> repetition penalty (prompt + output
tokens, HF style) -> frequency / presence penalties (output tokens, OpenAI style) ->
min_new_tokens blocking of EOS and stop_token_ids. Greedy rows take the argmax of that. Sampled
rows then divide by the temperature, keep top_k, then top_p of what is left, then min_p, and draw
by inverse CDF with one uniform number per row. A seeded row's number is `seeded_uniform(seed,
position)`, a pure function of its seed and the output position being drawn (a counter-based
generator, like Philox): its tokens do not depend on the other rows in the batch, nor on which
replica drew its earlier tokens (PD's prefill side draws position 0, the decode side goes on from
position 1) or whether they were recomputed (a retracted or resumed sequence draws each position's
number again, the same).

Whatever the logits hold, every id returned is in [0, vocab_size) and no NaN reaches a choice: a
NaN logit counts as -inf, +inf as the largest finite value, and a row left with no candidate at
all (every token masked, or broken logits) falls back to the argmax of the raw logits, then to
the first EOS token.

What a seed promises. Sequence i of a request with `seed` carries a generator seeded seed + i
(made once per sequence, workers/engine/request_builder.py) whose seed, all 64 bits of it, keys
its draws, so they depend on that seed and the output position only: not on its row, its
siblings or the other requests; and given the same logits row this sampler returns the same
token in any batch (every op here works row by row). Whether the logits row is the same is the
model's affair:
- default mode: the kernels round differently with the batch's shape (the packed GEMM's
  accumulation order follows the row count; a prompt computed whole, in chunks or after a cache
  hit, or decoded beside others, takes other shapes). The same request alone on an engine in the
  same state gives the same tokens: cold each time after a flush, or warm each time once its
  prompt is cached. Beside other requests, as choice 0 of n > 1, after a cache hit or with another
  chunk size the logits agree within bf16 rounding only, so greedy output agrees as far as the
  dtype allows and seeded sampling usually, but not always.
- deterministic mode (EngineConfig.deterministic): batch-invariant kernels; the same seeded
  request gives bitwise the same tokens whatever else runs, and choice 0 of n = 3 is the n = 1
  request (choice i is the request seeded seed + i).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.workers.protocol import SamplingParams, TokenLogprob
from radixserve.workers.sampling.logit_filters import TOP_P_CANDIDATES, keep_top_k, keep_top_k_top_p

_NEG_INF = float("-inf")
_F32_MAX = torch.finfo(torch.float32).max
# JSON has no -inf: a token the model gives no probability at all reports this logprob (as
# OpenAI-compatible servers do).
MIN_LOGPROB = -9999.0
_Pairs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, cols, values)
_MASK64 = 2**64 - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The number in [0, 1) that a sequence seeded `seed` draws for output position `position`
    (24 bits: a float32's precision). Any seed torch.Generator.manual_seed takes; all 64 bits count."""
    return (_mix64(_mix64((seed + 0x9E3779B97F4A7C15) & _MASK64) ^ position) >> 40) / float(1 << 24)


@dataclass
class SamplerRow:
    """One sequence of the batch, as the engine hands it over (plain data, no tensors)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated so far by this sequence
    # Created once per sequence from params.seed (Sampler.make_generator); its initial seed keys
    # the row's draws (seeded_uniform at position len(output_ids)). None = the sampler's own.
    generator: torch.Generator | None = None


@dataclass
class SampleOutput:
    token_ids: list[int]
    # One entry per row when any row asked for logprobs (None for rows that did not), else None.
    logprobs: list[TokenLogprob | None] | None = None


@dataclass
class SamplingBatch:
    """Tensors for one batch, built by `Sampler.prepare`. Each part is None when no row needs it.

    Row indices address rows of the logits; "local" indices address rows of the sampled subset.
    """

    size: int
    plain_greedy: bool = False  # nothing to do but an argmax
    bias: _Pairs | None = None  # added
    repetition: _Pairs | None = None  # penalty per (row, token) pair; duplicates are harmless
    penalty: _Pairs | None = None  # subtracted: freq * count + presence, unique pairs
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, cols) forced to -inf
    # Sampled rows (temperature > 0 and top_k != 1); None = every row is greedy.
    sample_rows: torch.Tensor | None = None
    all_sampled: bool = False
    temperatures: torch.Tensor | None = None  # [n, 1]
    top_k_rows: torch.Tensor | None = None  # local rows with top_k only: a topk, never a sort
    top_k: torch.Tensor | None = None  # [len(top_k_rows), 1]
    top_k_max: int = 0
    sort_rows: torch.Tensor | None = None  # local rows with top_p < 1 (and maybe top_k)
    sort_top_k: torch.Tensor | None = None  # [len(sort_rows), 1], vocab size when disabled
    sort_top_p: torch.Tensor | None = None  # [len(sort_rows), 1]
    sort_candidates: int = 0  # how many best tokens to try before a full sort (>= every finite k)
    log_min_p: torch.Tensor | None = None  # [n, 1], -inf when disabled
    unseeded_rows: torch.Tensor | None = None  # local rows drawing from the sampler's generator
    seeded_rows: torch.Tensor | None = None  # local rows with a seed ...
    seeded_uniforms: torch.Tensor | None = None  # ... and their numbers, [len(seeded_rows), 1]
    # Logprobs
    logprob_rows: torch.Tensor | None = None
    logprob_rows_list: list[int] = field(default_factory=list)
    top_logprobs: list[int] = field(default_factory=list)  # per logprob row

    @property
    def needs_processing(self) -> bool:
        return any(p is not None for p in (self.bias, self.repetition, self.penalty, self.blocked))


class Sampler:
    """Samples one token per row. `vocab_size` is the tokenizer's: wider logits are padding and cut."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device="cpu", seed: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._last_resort = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.device = torch.device(device)
        self.generator = self.make_generator(seed)

    def make_generator(self, seed: int | None) -> torch.Generator:
        """The generator a seeded sequence should carry in its SamplerRow (created once per
        sequence); its draws are `seeded_uniform(seed, position)`, the generator's own stream unused."""
        g = torch.Generator(device=self.device)
        if seed is None:
            g.seed()
        else:
            g.manual_seed(seed)
        return g

    # ---------------------------------------------------------------- prepare (host, once per batch)

    def prepare(self, rows: list[SamplerRow]) -> SamplingBatch:
        batch = SamplingBatch(size=len(rows))
        batch.bias = self._bias_pairs(rows)
        batch.repetition = self._repetition_pairs(rows)
        batch.penalty = self._penalty_pairs(rows)
        batch.blocked = self._blocked_pairs(rows)
        self._prepare_draw(batch, rows)
        self._prepare_logprobs(batch, rows)
        batch.plain_greedy = (
            batch.sample_rows is None and not batch.needs_processing and batch.logprob_rows is None
        )
        return batch

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _pairs(self, rows: list[int], cols: list[int], values: list[float]) -> _Pairs | None:
        if not rows:
            return None
        return (
            self._tensor(rows, torch.long),
            self._tensor(cols, torch.long),
            self._tensor(values, torch.float32),
        )

    def _in_vocab(self, ids) -> list[int]:
        return [t for t in ids if 0 <= t < self.vocab_size]

    def _bias_pairs(self, rows: list[SamplerRow]) -> _Pairs | None:
        triples = [
            (i, t, b)
            for i, row in enumerate(rows)
            for t, b in (row.params.logit_bias or {}).items()
            if 0 <= t < self.vocab_size
        ]
        return self._pairs(*map(list, zip(*triples))) if triples else None

    def _repetition_pairs(self, rows: list[SamplerRow]) -> _Pairs | None:
        r, c, v = [], [], []
        for i, row in enumerate(rows):
            p = row.params.repetition_penalty
            if p != 1.0:
                ids = self._in_vocab(row.prompt_ids) + self._in_vocab(row.output_ids)
                r += [i] * len(ids)
                c += ids
                v += [p] * len(ids)
        return self._pairs(r, c, v)

    def _penalty_pairs(self, rows: list[SamplerRow]) -> _Pairs | None:
        triples = []
        for i, row in enumerate(rows):
            freq, pres = row.params.frequency_penalty, row.params.presence_penalty
            if freq != 0.0 or pres != 0.0:
                counts = Counter(self._in_vocab(row.output_ids))
                triples += [(i, t, freq * n + pres) for t, n in counts.items()]
        return self._pairs(*map(list, zip(*triples))) if triples else None

    def _blocked_pairs(self, rows: list[SamplerRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        r, c = [], []
        for i, row in enumerate(rows):
            if len(row.output_ids) < row.params.min_new_tokens:
                ids = self._in_vocab(set(self.eos_token_ids) | set(row.params.stop_token_ids))
                r += [i] * len(ids)
                c += ids
        if not r:
            return None
        return self._tensor(r, torch.long), self._tensor(c, torch.long)

    def _prepare_draw(self, batch: SamplingBatch, rows: list[SamplerRow]) -> None:
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled:
            return
        params = [rows[i].params for i in sampled]
        V = self.vocab_size
        batch.sample_rows = self._tensor(sampled, torch.long)
        batch.all_sampled = len(sampled) == len(rows)
        batch.temperatures = self._tensor([[p.temperature] for p in params], torch.float32)
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        k_only = [j for j, p in enumerate(params) if p.top_p >= 1 and top_k[j] < V]
        if k_only:
            batch.top_k_rows = self._tensor(k_only, torch.long)
            batch.top_k = self._tensor([[top_k[j]] for j in k_only], torch.long)
            batch.top_k_max = max(top_k[j] for j in k_only)
        by_sort = [j for j, p in enumerate(params) if p.top_p < 1]
        if by_sort:
            batch.sort_rows = self._tensor(by_sort, torch.long)
            batch.sort_top_k = self._tensor([[top_k[j]] for j in by_sort], torch.long)
            batch.sort_top_p = self._tensor([[params[j].top_p] for j in by_sort], torch.float32)
            finite = [top_k[j] for j in by_sort if top_k[j] < V]
            batch.sort_candidates = min(V, max([TOP_P_CANDIDATES] + finite))
        if any(p.min_p > 0 for p in params):
            batch.log_min_p = self._tensor(
                [[math.log(p.min_p) if p.min_p > 0 else _NEG_INF] for p in params], torch.float32
            )
        seeded, uniforms, unseeded = [], [], []
        for j, i in enumerate(sampled):
            g = rows[i].generator
            if g is None:
                unseeded.append(j)
            else:
                seeded.append(j)
                uniforms.append([seeded_uniform(g.initial_seed(), len(rows[i].output_ids))])
        if seeded:
            batch.seeded_rows = self._tensor(seeded, torch.long)
            batch.seeded_uniforms = self._tensor(uniforms, torch.float32)
        if unseeded:
            batch.unseeded_rows = self._tensor(unseeded, torch.long)

    def _prepare_logprobs(self, batch: SamplingBatch, rows: list[SamplerRow]) -> None:
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs or row.params.top_logprobs > 0]
        if wanted:
            batch.logprob_rows = self._tensor(wanted, torch.long)
            batch.logprob_rows_list = wanted
            batch.top_logprobs = [rows[i].params.top_logprobs for i in wanted]

    # ---------------------------------------------------------------- sample (device)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """logits: [B, V'] with V' >= vocab_size; grammar masks are already applied (apply_bitmask)."""
        raw = logits[:, : self.vocab_size]
        if batch.plain_greedy:
            return SampleOutput(self._argmax(raw, raw).tolist())
        x = self.process_logits(logits, batch)
        if batch.all_sampled:
            tokens = self._draw(x, raw, batch)
        else:
            tokens = self._argmax(x, raw)
            if batch.sample_rows is not None:
                rows = batch.sample_rows
                picked = self._draw(x.index_select(0, rows), raw.index_select(0, rows), batch)
                tokens = tokens.index_copy(0, rows, picked)
        tokens = tokens.clamp(0, self.vocab_size - 1)  # the guarantee, whatever happened above
        return SampleOutput(tokens.tolist(), self._logprobs(raw, tokens, batch))

    def _argmax(self, x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """Each row's best token, never a NaN one. A row with nothing above -inf falls back to the
        argmax of its raw logits, then to the first EOS token."""
        tokens = x.argmax(-1)  # a NaN counts as the largest value here: checked below
        if bool((x.gather(1, tokens[:, None]) > _NEG_INF).all()):
            return tokens
        best, idx = x.nan_to_num(nan=_NEG_INF, neginf=_NEG_INF).max(-1)
        raw_best, raw_idx = raw.nan_to_num(nan=_NEG_INF, neginf=_NEG_INF).max(-1)
        fallback = torch.where(raw_best > _NEG_INF, raw_idx, self._last_resort)
        return torch.where(best > _NEG_INF, idx, fallback)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Logits after bias, penalties and min_new_tokens blocking, before the temperature. Never
        modifies `logits`; returns it (cut to the vocab) when there is nothing to do."""
        x = logits[:, : self.vocab_size]
        if not batch.needs_processing:
            return x
        x = x.to(torch.float32, copy=True)
        if batch.bias is not None:
            r, c, v = batch.bias
            x.index_put_((r, c), v, accumulate=True)
        if batch.repetition is not None:
            r, c, p = batch.repetition
            v = x[r, c]
            # Pairs may repeat; each copy writes the same value computed from the unpenalised logit.
            x[r, c] = torch.where(v > 0, v / p, v * p)
        if batch.penalty is not None:
            r, c, v = batch.penalty
            x.index_put_((r, c), -v, accumulate=True)
        if batch.blocked is not None:
            x[batch.blocked] = _NEG_INF
        return x

    def _draw(self, x: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """x, raw: processed and raw logits of the sampled rows -> sampled token per row."""
        assert batch.temperatures is not None  # prepared for every batch with sampled rows
        s = (x / batch.temperatures).nan_to_num(nan=_NEG_INF, posinf=_F32_MAX, neginf=_NEG_INF)
        if batch.top_k_rows is not None and batch.top_k is not None:
            kept = keep_top_k(s.index_select(0, batch.top_k_rows), batch.top_k, batch.top_k_max)
            s.index_copy_(0, batch.top_k_rows, kept)
        if batch.sort_rows is not None and batch.sort_top_k is not None and batch.sort_top_p is not None:
            kept = keep_top_k_top_p(
                s.index_select(0, batch.sort_rows), batch.sort_top_k, batch.sort_top_p, batch.sort_candidates
            )
            s.index_copy_(0, batch.sort_rows, kept)
        if batch.log_min_p is not None:
            # p_i < min_p * p_max  <=>  s_i - s_max < log(min_p): no softmax needed.
            s.masked_fill_(s - s.amax(-1, keepdim=True) < batch.log_min_p, _NEG_INF)
        drawn = self._inverse_cdf(s.softmax(-1), batch)
        alive = s.amax(-1) > _NEG_INF  # else the softmax is NaN: nothing to draw from
        if bool(alive.all()):
            return drawn
        return torch.where(alive, drawn.clamp(max=self.vocab_size - 1), self._argmax(x, raw))

    def _inverse_cdf(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One uniform number per row picks the token where the cumulative probability passes it.

        Cheaper on CPU than a race over V random numbers per row (the RNG, not the arithmetic, is the
        cost), and just as row-independent: a seeded row's number is its own (seeded_uniform)."""
        # A filtered token adds exactly 0, so its cumulative value equals its predecessor's and
        # no target can land on it. (CPU cumsum accumulates float32 in double: no drift over 49k.)
        cum = probs.cumsum(-1)
        total = cum[:, -1:]
        target = self._uniform(probs.shape[0], batch) * total
        # Strictly below the total, so the last token with nonzero mass is the furthest pick.
        target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cum, target, right=True)[:, 0]

    def _uniform(self, n: int, batch: SamplingBatch) -> torch.Tensor:
        if batch.unseeded_rows is None and batch.seeded_uniforms is not None:
            return batch.seeded_uniforms  # every row seeded, in order
        u = torch.empty(n, 1, dtype=torch.float32, device=self.device)
        if batch.unseeded_rows is not None:
            if batch.seeded_rows is None:
                u.uniform_(generator=self.generator)
            else:
                drawn = torch.empty(batch.unseeded_rows.shape[0], 1, device=self.device).uniform_(
                    generator=self.generator
                )
                u.index_copy_(0, batch.unseeded_rows, drawn)
        if batch.seeded_rows is not None and batch.seeded_uniforms is not None:
            u.index_copy_(0, batch.seeded_rows, batch.seeded_uniforms)
        return u

    def _logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
    ) -> list[TokenLogprob | None] | None:
        """From the model's own distribution (before bias, penalties, masks and temperature)."""
        if batch.logprob_rows is None:
            return None
        rows = (
            raw.index_select(0, batch.logprob_rows)
            .float()
            .nan_to_num(nan=_NEG_INF, posinf=_F32_MAX, neginf=_NEG_INF)
        )
        lp = rows.log_softmax(-1).nan_to_num(nan=MIN_LOGPROB).clamp(min=MIN_LOGPROB)
        chosen = lp.gather(1, tokens.index_select(0, batch.logprob_rows)[:, None])[:, 0]
        k = max(batch.top_logprobs)
        top_v, top_i = lp.topk(k, -1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        out: list[TokenLogprob | None] = [None] * batch.size
        tok_list, chosen_list = tokens.tolist(), chosen.tolist()
        for j, (i, n, vals, ids) in enumerate(
            zip(batch.logprob_rows_list, batch.top_logprobs, top_v.tolist(), top_i.tolist())
        ):
            out[i] = TokenLogprob(tok_list[i], chosen_list[j], list(zip(ids[:n], vals[:n])))
        return out
