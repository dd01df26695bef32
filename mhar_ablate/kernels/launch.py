"""Launch and occupancy helpers shared by the routing kernels (``mhar_triton``, ``history``, ``column``).

* ``launch``: run a ``@triton.jit`` kernel on CUDA tensors, or through Triton's interpreter on CPU
  tensors whether or not ``TRITON_INTERPRET=1`` was set before triton was imported (use fp32 there: the
  interpreter's bf16 arithmetic is not faithful).
* ``head_meta`` / ``tile_width``: the head split every kernel uses (``products_fit``: whether its blocks
  are wide enough for ``tl.dot``); ``by_width``: a launch table's entry for a model width. Block shapes must
  be powers of two, and padding a head width such as 160 (d = 1280, H = 8) up to 256 wastes 37.5 % of the registers and
  lanes, so each head of width DH is split into a part of DA channels (the largest power of two <= DH)
  and a rest of DB = DH - DA channels, each its own block (160 = 128 + 32). When DH is a power of two the
  rest is an empty block of width 1, masked off, or compiled out where a kernel takes ``HAS_B``.
* ``resident_programs`` / ``persistent_programs``: how many programs of a compiled kernel fit on the
  GPU at once, the grid of the persistent backward kernels (more would leave a second, partial wave of
  programs that each still walk their whole share of the work).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

__all__ = ["launch", "head_meta", "products_fit", "tile_width", "by_width", "num_sms", "resident_programs",
           "persistent_programs", "RESIDENT"]


# ----------------------------------------------------------------------------------------------------------
# Interpreter on CPU tensors
# ----------------------------------------------------------------------------------------------------------

_INTERPRETED: dict[int, object] = {}


def _interpreted_fn(kernel):
    """The interpreter version of a ``@triton.jit`` function (the function itself if triton was imported
    with TRITON_INTERPRET=1, in which case ``triton.jit`` already returned one)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    fn = _INTERPRETED.get(id(kernel))
    if fn is None:
        fn = _INTERPRETED[id(kernel)] = InterpretedFunction(kernel.fn)
    return fn


@contextlib.contextmanager
def _interpreted():
    """Run Triton's interpreter on CPU tensors even when triton was imported without TRITON_INTERPRET=1.

    Triton picks interpreter or compiler when a function is decorated, and ``triton.language``'s own
    helpers (``tl.zeros``, ``tl.sum``, ...) are decorated at import. Without the variable those helpers are
    compiled-only ``JITFunction`` objects that refuse to be called from Python; for the duration of an
    interpreted launch, calls to them are routed through their interpreter versions instead.
    """
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__

    def call(self, *args, **kwargs):
        return _interpreted_fn(self)(*args, **kwargs)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original


_COMPILE_OPTIONS = ("num_warps", "num_stages", "maxnreg")  # meaningless to the interpreter


def launch(kernel, grid, args, meta: dict, device: torch.device) -> None:
    """``kernel[grid](*args, **meta)`` on ``device``: compiled on CUDA, interpreted on the CPU."""
    if device.type == "cpu":
        with _interpreted():
            _interpreted_fn(kernel)[grid](*args, **{k: v for k, v in meta.items() if k not in _COMPILE_OPTIONS})
    else:
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)


# ----------------------------------------------------------------------------------------------------------
# Head split
# ----------------------------------------------------------------------------------------------------------


def head_meta(d: int, num_heads: int, *, has_b: bool = False) -> dict:
    """The kernels' head constants: D, H, head width DH = DA + DB, the rest padded to BLOCK_DB; with
    ``has_b`` also HAS_B (the rest is compiled in only when the head width is not a power of two)."""
    dh = d // num_heads
    da = 1 << (dh.bit_length() - 1)
    db = dh - da
    meta = {"D": d, "H": num_heads, "DH": dh, "DA": da, "DB": db, "BLOCK_DB": triton.next_power_of_2(max(db, 1))}
    if has_b:
        meta["HAS_B"] = db > 0
    return meta


def products_fit(meta: dict) -> bool:
    """Whether a head's blocks (``head_meta``'s DA and, with HAS_B, BLOCK_DB) are wide enough for ``tl.dot``."""
    return meta["DA"] >= 16 and (not meta["HAS_B"] or meta["BLOCK_DB"] >= 16)


def tile_width(d: int, num_heads: int) -> int:
    """Channels a token occupies in the kernels' blocks (d plus the rest blocks' padding)."""
    meta = head_meta(d, num_heads)
    return num_heads * (meta["DA"] + (meta["BLOCK_DB"] if meta["DB"] else 0))


def by_width(table: dict, d: int):
    """A launch table's entry for model width ``d``: that of the nearest width it lists (the narrower on a tie)."""
    return table[min(table, key=lambda w: (abs(w - d), w))]


# ----------------------------------------------------------------------------------------------------------
# Occupancy
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


RESIDENT: dict[tuple, int] = {}  # (kernel id, device index, dtype, launch meta) -> programs per SM


def resident_programs(kernel, args, meta: dict, device: torch.device) -> int:
    """How many programs of the compiled ``kernel`` fit on one SM at once (registers, warps, shared
    memory), compiled for ``args`` (whose first tensor's dtype is part of the cache key) and ``meta``."""
    key = (id(kernel), device.index, args[0].dtype, tuple(sorted(meta.items())))
    if key not in RESIDENT:
        with torch.cuda.device(device):
            compiled = kernel.warmup(*args, grid=(1,), **meta)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(device)
        num_warps = meta.get("num_warps", 4)
        regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256  # allocated per warp, 256 at a time
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
        by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
        smem = compiled.metadata.shared
        smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        by_smem = smem_per_sm // smem if smem else by_warps
        RESIDENT[key] = max(1, min(by_regs, by_warps, by_smem, 32))
    return RESIDENT[key]


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def persistent_programs(kernel, args, meta: dict, device: torch.device, work: int,
                        programs_per_sm: int | None = None) -> int:
    """Programs of a persistent kernel: as many as fit on the GPU at once (``programs_per_sm`` overrides
    the count per SM), at most one per piece of ``work``; on the interpreter a few, so that tests walk
    the persistent loop and its idle tail."""
    if device.type == "cpu":
        return min(work, 3)
    if programs_per_sm is None:
        programs_per_sm = resident_programs(kernel, args, meta, device)
    return max(1, min(work, programs_per_sm * num_sms(device_index(device))))
