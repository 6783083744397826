"""
Letting go of a memory-mapped tensor's pages once nothing reads it whole.

A tensor read from a safetensors file (or a torch.load(mmap=True) one) is the file's pages,
mapped: a page becomes resident, and counts in the process's memory, when it is first
read, and stays so while the mapping lives (a .pt file's mapping lives as long as any of
its tensors). Loading reads every weight once (the finite-values check), and some are read
no more: a weight converted to the run's dtype or quantized, and the token embedding, read
a row per token once nothing else reads the whole table (its table: 525 MB of bf16 at the
Llama-3.2-1B shape, 1 GB at the Llama-3-8B shape). madvise(MADV_DONTNEED) drops such
pages from this process; a later read faults its page back in from the file (through the
kernel's page cache), with the file's bytes: the values never change. That is what
llama.cpp gets from its memory-mapped GGUF: resident is what a run touches.

Only for a tensor lying inside one file mapping of this process (/proc/self/maps), which
the loaders alone call it with, on a tensor they have just read from its file and nothing
has written to: a written page of a private mapping would revert to the file's bytes, and
on anonymous memory (a tensor converted or copied) MADV_DONTNEED would zero the tensor, so
anything not a file's mapping is left as it is, and so is everything where /proc/self/maps
does not exist (not Linux): nothing is released there. (/proc/self/smaps would also say
whether a page was written, but reading it walks every page table of the process: ~20 ms
a call, 2 s over a 1B model's 113 weights.)
"""

import ctypes
import mmap

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
MAPS = "/proc/self/maps"


def release_file_pages(tensor):
    """Drop tensor's resident pages where it lies in a file's mapping (see above); True
    where they were dropped."""
    start, stop = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, stop // page * page  # whole pages inside the tensor
    if last <= first or not in_file_mapping(start, stop):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, last - first, MADV_DONTNEED) == 0


def in_file_mapping(start, stop):
    """Whether [start, stop) lies inside one mapping of a file. A line of /proc/self/maps is
    "lo-hi perms offset dev inode path": no path for anonymous memory, a [bracketed] one for
    the heap and the stack."""
    try:
        with open(MAPS) as maps:
            lines = maps.read().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split(maxsplit=5)
        lo, hi = (int(bound, 16) for bound in fields[0].split("-"))
        if lo <= start and stop <= hi:
            return len(fields) == 6 and fields[5].startswith("/")
    return False
