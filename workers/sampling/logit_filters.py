"""Top-k / top-p filters over temperature-scaled logits (rows x vocab); filtered entries become -inf.

A full sort of a 49k vocabulary costs tens of milliseconds per row batch on a CPU, so top-p first
looks at the best `candidates` tokens only (a topk) and sorts a row only when those hold less than
p of its mass, which is exact either way. On accelerators the sort is cheap and needs no host sync,
so it is used directly.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
TOP_P_CANDIDATES = 256


def keep_top_k(s: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Mask all but each row's k largest (ties at the k-th value are kept). k: [n, 1], k_max = max k."""
    kth = s.topk(k_max, -1).values.gather(1, k - 1)
    return s.masked_fill(s < kth, _NEG_INF)


def keep_top_k_top_p(s: torch.Tensor, k: torch.Tensor, p: torch.Tensor, candidates: int) -> torch.Tensor:
    """Top-k, then the smallest best-first prefix of the rest whose probability reaches p.

    k, p: [n, 1]; k == vocab size means no top-k. `candidates` must be >= every k below the vocab
    size. A token is dropped once the mass strictly before it reaches p, so the best one stays."""
    if s.device.type != "cpu":
        return _by_sort(s, k, p)
    V = s.shape[1]
    vals, idx = s.softmax(-1).topk(min(candidates, V), -1)
    ranks = torch.arange(vals.shape[1], device=s.device)
    vals = vals.masked_fill(ranks >= k, 0.0)
    # The top-k set's mass; all of it when top-k is off (the softmax sums to one).
    mass = torch.where(k >= V, torch.ones_like(p), vals.sum(-1, keepdim=True))
    cum = vals.cumsum(-1)
    keep = (cum - vals < p * mass) & (ranks < k)
    out = torch.full_like(s, _NEG_INF).scatter_(-1, idx, s.gather(-1, idx).masked_fill(~keep, _NEG_INF))
    short = (cum[:, -1] < p[:, 0] * mass[:, 0]).nonzero()[:, 0]  # a host sync: free on a CPU
    if short.numel():
        out.index_copy_(0, short, _by_sort(s.index_select(0, short), k[short], p[short]))
    return out


def _by_sort(s: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_s, order = s.sort(-1, descending=True)
    ranks = torch.arange(s.shape[1], device=s.device)
    sorted_s = sorted_s.masked_fill(ranks >= k, _NEG_INF)
    probs = sorted_s.softmax(-1)
    sorted_s = sorted_s.masked_fill(probs.cumsum(-1) - probs >= p, _NEG_INF)
    return torch.empty_like(s).scatter_(-1, order, sorted_s)
