"""The engine keeps freed activation buffers in the heap: a reused buffer costs no page faults."""
import ctypes
import resource

import pytest

from executor.core.malloc_tuning import keep_freed_memory


def _fault_count_of_one_cycle(libc, n: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)  # touch every page
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_block_is_reused_without_page_faults():
    if not keep_freed_memory():
        pytest.skip("no glibc mallopt here")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    n = 64 << 20  # above glibc's largest default mmap threshold (32 MiB): unmapped on free without the setting
    _fault_count_of_one_cycle(libc, n)
    assert _fault_count_of_one_cycle(libc, n) < n // 4096 // 10
