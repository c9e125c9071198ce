"""The C allocator's settings of a smallbatch process (glibc's malloc; elsewhere nothing).

glibc serves a block larger than its *mmap threshold* with a fresh ``mmap`` and unmaps it
on ``free``; the threshold starts at 128 KiB and only creeps up as blocks are freed, and
memory at the top of the heap is handed back to the system beyond the *trim threshold*.
A training step allocates and frees the same activation-sized blocks every step (the
default study at batch 256: 512 views x 32 channels x 16 x 16 floats = 16 MiB per map), so
each step faulted its pages in again.  Measured on the default study's cells (one thread,
one process each, side by side): batch 256 went from 10,300 minor page faults and 20 ms of
system time in a 147-ms step to 1,400 and 2.7 ms (136 -> 125 ms per step in a second
pair), batch 64 from 34.8 to 31.8 ms, batch 16 from 12.3 to 11.9 ms; the checkpoint after an
epoch is bitwise the same (the allocator moves no arithmetic).

:func:`tune` fixes the mmap threshold at glibc's maximum and raises the trim threshold, so
freed blocks stay in the heap for the next step; blocks above 32 MiB are still mapped and
unmapped, and a process keeps at most its own peak of smaller blocks.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TRIM_THRESHOLD = 1 << 30


def tune() -> bool:
    """Set this process's malloc thresholds (above); False where the C library has no
    ``mallopt`` (not glibc) or refuses the values."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
