"""Freed tensor memory goes back to the OS (glibc's malloc on Linux).

An engine process allocates and frees many large buffers of varying sizes: KV caches sized to
each batch, prefix-cache entries sized to each prompt, prefill activations. glibc serves a
large allocation with its own mmap, returned to the OS on free, but it raises that threshold
each time such a block is freed (up to 32 MiB), after which blocks of those sizes come from
the heap and their pages stay with the process. Measured on a GRPO rollout worker (the shipped
model, groups of 8 sampled episodes): live tensors held at ~280 MB (the 256 MB prefix cache
and the model) while the process grew from 0.7 to 5.4 GB in 9 groups, and two such workers
beside a trainer were killed by the kernel's OOM killer. A fixed threshold (which also turns
the adjustment off) kept the same loop at 1.1 GB, but every large buffer then costs an mmap
and zeroed pages: agent turns ran ~30 % slower. So the threshold stays glibc's, and `trim()`
hands the free pages back after a generation (`malloc_trim`), at most every `INTERVAL_S`
(after every one, agent turns ran ~6 % slower per token).

`trim()` does it unless APPRENTICE_BOUND_HEAP=0. Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

INTERVAL_S = 2.0
_libc: ctypes.CDLL | None = None
_ok: bool | None = None
_last = float("-inf")


def trim() -> bool:
    """Return the heap's free pages to the OS (glibc's malloc_trim) unless it was done less
    than `INTERVAL_S` ago; whether this process can."""
    global _libc, _ok, _last
    if _ok is None:
        _ok = False
        if sys.platform.startswith("linux") and os.environ.get("APPRENTICE_BOUND_HEAP") != "0":
            try:
                _libc = ctypes.CDLL("libc.so.6")
                _libc.malloc_trim.argtypes = [ctypes.c_size_t]
                _ok = True
            except (OSError, AttributeError):    # not glibc
                pass
    if _ok and time.monotonic() - _last >= INTERVAL_S:
        _libc.malloc_trim(0)
        _last = time.monotonic()
    return bool(_ok)
