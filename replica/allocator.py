"""Keep freed activation memory inside the process (glibc's malloc, on Linux).

A CPU forward pass allocates and frees the same activations, a few megabytes each, in every
layer. glibc hands allocations above its mmap threshold to the kernel with ``mmap`` and gives
them back with ``munmap`` on free, and it trims free memory at the top of its heap back to the
kernel too: either way the next tensor of that size page-faults its memory in again, one
zero-filled 4 KiB page at a time. Raising both thresholds keeps that memory in the heap, where
the next layer's tensors reuse it warm. vLLM's CPU backend gets the same effect by preloading
tcmalloc; ``mallopt`` needs no preload and no extra package.

The heap then keeps its high-water mark of activation memory (a few hundred megabytes for a
1,024-token step of SmolLM2) instead of returning it between steps; the KV cache and weights
are allocated once and are not affected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("prefixmesh.replica")

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): a single larger
# tensor still gets its own mapping. Free memory at the top of the heap is given back only past
# _TRIM, above a step's activations.
_MMAP_MAX = 32 * 1024 * 1024
_TRIM = 512 * 1024 * 1024

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where it cannot.

    ``PREFIXMESH_MALLOPT=0`` leaves the allocator alone (for A/B measurements).
    """
    global _done
    if _done:
        return True
    if os.environ.get("PREFIXMESH_MALLOPT", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM) == 1
    if not ok:
        log.debug("mallopt refused the thresholds; the allocator is left as it was")
    _done = ok
    return ok
