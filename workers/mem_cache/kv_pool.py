"""KV memory of one replica: token slots for K/V tensors, and the per-request slot table.

Pure bookkeeping over integer slot ids plus the raw K/V buffers; it knows nothing about requests
or the radix tree. Free lists are FIFO deques (O(1) per page): a fresh pool hands out slots in
ascending order and freed pages go to the back of the queue, so reuse order is deterministic:
everything never-used is handed out before anything freed, and freed pages come back in the
order they were freed.
"""

from __future__ import annotations

from collections import deque

import torch

from radixserve.kernels import cpu_ops


class KVPool:
    """Per-layer K and V tensors over token slots.

    dtype torch.int8 is the int8 KV cache (kernels/csrc/kv_int8.h): a (token, head) row holds the
    head's values rounded to int8 and, in its last 4 bytes, the float32 scale they share, so the
    buffers are [slots, heads, head_dim + 4] int8 and whatever copies rows copies the scales.

    dtype FP8 (float8_e4m3fn) is the fp8 KV cache: layer l holds K / k_scales[l] and V /
    v_scales[l] (per-tensor scales, the checkpoint's or 1.0), and the attention kernels multiply
    them back; copies move the bytes as they are (`raw`).

    Slot 0 (the whole first page) is reserved as a dummy/padding slot: it is never allocated, so
    kernels may point padding entries at it and write garbage there. Allocation is by pages of
    `page_size` slots; slot s lives in page s // page_size, and a request always owns whole pages.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        dtype=torch.bfloat16,
        device="cpu",
        page_size: int = 1,
        kv_scales: tuple[list[float], list[float]] | None = None,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.size = self.num_pages * page_size
        self.dtype = dtype
        self.head_dim = head_dim
        self.device = torch.device(device)
        # What a stored row is multiplied by when read: only an fp8 pool stores scaled rows.
        k_scales, v_scales = kv_scales or ([1.0] * num_layers, [1.0] * num_layers)
        if len(k_scales) != num_layers or len(v_scales) != num_layers:
            raise ValueError(f"kv_scales need one K and one V scale for each of {num_layers} layers")
        if kv_scales is not None and dtype != FP8 and any(x != 1.0 for x in (*k_scales, *v_scales)):
            raise ValueError(f"KV scales other than 1.0 are for an fp8 pool, not {dtype}")
        self.k_scales, self.v_scales = [float(x) for x in k_scales], [float(x) for x in v_scales]
        # On CPU torch.empty: the OS maps pages lazily, so an oversized pool costs nothing until
        # touched. A GPU's caching allocator hands back recycled memory, which may hold NaNs that a
        # masked attention weight (0 * NaN) would spread: zeros there.
        shape = (num_slots + page_size, num_kv_heads, row_width(head_dim, dtype))
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        self.k_buffers = [alloc(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [alloc(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Padding entries point at the dummy page and are masked out, but a masked NaN still
        # poisons `probs @ V` (0 * NaN): keep the dummy page finite.
        for buf in self.k_buffers + self.v_buffers:
            buf[:page_size].zero_()
        # Page 0 is the reserved dummy page; pages 1..num_pages are allocatable.
        self._free_pages: deque[int] = deque(range(1, self.num_pages + 1))
        self._page_free = bytearray(self.num_pages + 1)
        self._page_free[1:] = b"\x01" * self.num_pages

    def alloc(self, n: int, last_slot: int | None = None) -> list[int] | None:
        """Return `n` new slots for one request, or None (allocating nothing) if not enough free.

        With page_size > 1 and `last_slot` the request's current last slot, the rest of that slot's
        page is used first (it already belongs to the request), then whole fresh pages. Position i
        of a request therefore sits at page offset i % page_size when its first slot starts a page.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        p = self.page_size
        head: list[int] = []
        if p > 1 and last_slot is not None and (last_slot + 1) % p != 0:
            if self._page_free[last_slot // p] or last_slot < p:
                raise AssertionError(f"last_slot {last_slot} is not in an allocated page")
            head = list(range(last_slot + 1, min(last_slot + 1 + n, (last_slot // p + 1) * p)))
        rest = n - len(head)
        need = -(-rest // p)
        if need > len(self._free_pages):
            return None
        out = head
        for _ in range(need):
            page = self._free_pages.popleft()
            self._page_free[page] = 0
            start = page * p
            out.extend(range(start, start + min(p, n - len(out))))
        return out

    def free(self, slots) -> None:
        """Return the pages that `slots` live in (a list or 1-D tensor) to the back of the queue.

        The caller owns those pages whole. Double free and freeing the reserved page raise.
        """
        if isinstance(slots, torch.Tensor):
            slots = slots.tolist()
        p = self.page_size
        pages = slots if p == 1 else dict.fromkeys(s // p for s in slots)
        page_free = self._page_free
        for page in pages:
            if page <= 0 or page > self.num_pages:
                raise AssertionError(f"freeing slot page {page}: reserved or out of range")
            if page_free[page]:
                raise AssertionError(f"double free of page {page} (slot {page * p})")
            page_free[page] = 1
            self._free_pages.append(page)

    def available(self) -> int:
        """Free slots (free pages * page_size)."""
        return len(self._free_pages) * self.page_size

    def is_free(self, slot: int) -> bool:
        """Whether `slot`'s page is on the free list (used by integrity checks)."""
        return bool(self._page_free[slot // self.page_size])

    @property
    def quantized(self) -> bool:
        """Whether the rows are int8 with their scales (not the model's dtype)."""
        return self.dtype == torch.int8

    @staticmethod
    def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) -> int:
        """Bytes one token's K and V take across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * row_width(head_dim, dtype) * elem


# Bytes of the float32 scale after an int8 row's values.
INT8_SCALE_BYTES = 4
# The fp8 KV cache's element type (kv_cache_dtype fp8_e4m3): e4m3, finite, largest value 448.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def raw(buf: torch.Tensor) -> torch.Tensor:
    """`buf` as bytes where it holds fp8 (torch's CPU index_copy_ and equal have no fp8 kernel),
    else itself: for copying rows between pools, tiers and transfers as they are."""
    return buf.view(torch.uint8) if buf.dtype == FP8 else buf


def fp8_rows(x: torch.Tensor, scale: float) -> torch.Tensor:
    """K or V rows for an fp8 pool whose layer scale is `scale`: x / scale, saturated to e4m3's
    range (a value past it would otherwise become NaN on some devices), rounded to nearest."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, head) row of a pool of `dtype`."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def pool_dtype(
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    backend: str,
    head_dim: int,
    group: int,
    device: torch.device | None = None,
) -> torch.dtype:
    """The pool's dtype for an engine's kv_cache_dtype: "auto" is the model's; "int8" where its
    kernels run (a bf16 model on the cpu attention backend, csrc/kv_int8.h); "fp8_e4m3" on the
    triton backend (and torch_ref, the reference), on a GPU of compute capability 8.9 or later
    (Triton's e4m3 type); else ValueError."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        if backend not in ("triton", "torch_ref"):
            raise ValueError(
                f"kv_cache_dtype fp8_e4m3 runs on the triton attention backend (the default on a GPU), not {backend}"
            )
        if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(
                "kv_cache_dtype fp8_e4m3 needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                f"this one is {torch.cuda.get_device_capability(device)}"
            )
        return FP8
    if model_dtype != torch.bfloat16 or backend != "cpu" or not cpu_ops.kv_int8_available(head_dim, group):
        raise ValueError(
            "kv_cache_dtype int8 runs a bfloat16 model on the cpu attention backend of a CPU with "
            "AVX512-BF16, head size 64 (up to 8 query heads a KV head) or 128 (up to 4); this one: "
            f"{model_dtype}, the {backend} backend, head size {head_dim}, {group} query heads a KV head"
        )
    return torch.int8
