"""
Building a C++ operator of ours on first use, safely: torch.utils.cpp_extension compiles a
source file (with the compiler torch.compile needs, through ninja) into a library that
registers its operators with TORCH_LIBRARY, and keeps it for later processes, so only the
first run on a machine pays for the build (~15-30 s on 2 cores). What this file adds is
what a server needs around it: one build at a time that a killed build cannot block, a
library per kind of CPU, a build folder only this user can write (the library it holds is
loaded and run: one planted there by someone else would be their code running as us), and
a failed build or an unsafe folder reported in a line rather than raised.
"""

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from generation.private_folder import UnsafeFolder, private_folder

FLAGS = ["-O3", "-march=native", "-fopenmp"]  # -fopenmp: torch's threads (at::parallel_for)


def build_kernel(source, name):
    """Compile and load source (a .cpp registering operators), or find it built; returns None,
    or the first line of what went wrong (no ninja, no compiler, a failed build)."""
    from torch.utils.cpp_extension import load  # its import alone takes a second
    name = library_name(name)
    try:
        directory = build_directory(name)
        with one_build_at_a_time(directory):
            load(name=name, sources=[str(source)], build_directory=str(directory),
                 is_python_module=False, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError, UnsafeFolder) as e:
        return str(e).splitlines()[0][:200] if str(e) else type(e).__name__  # a compiler's log is long
    return None


def library_name(name):
    """name with the CPU's instruction set: the library is built for this CPU's
    (-march=native), so a folder shared with another kind of machine keeps a build for each."""
    return f"{name}_{torch.backends.cpu.get_cpu_capability().lower()}"


def build_directory(name):
    """Where the library named name (library_name's) is built and kept: torch's extensions
    folder ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), one build per Python and
    torch version (the library links against both); a private folder (private_folder.py:
    this user's, mode 0700), else UnsafeFolder."""
    from torch.utils.cpp_extension import get_default_build_root
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return private_folder(root / version / name)


@contextmanager
def one_build_at_a_time(directory):
    """Hold the build folder while loading. torch's own lock is a file, which a build killed
    midway (kill -9, the OOM killer, a power cut) leaves behind, and every later load then
    waits for it forever: a server that never starts. This lock is the operating system's
    (flock), released when its process dies, so whoever holds it knows no build is running
    and can delete torch's file."""
    import fcntl  # POSIX: on Windows the ImportError means no kernel (build_kernel)
    # O_NOFOLLOW: a link planted at the lock's name is refused, not followed and truncated
    fd = os.open(directory / "kvcache_gpt.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with open(fd, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits while another process builds
        (directory / "lock").unlink(missing_ok=True)  # torch's, left by a build that died
        yield
