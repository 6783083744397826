"""
llama.cpp, the peer, built for this CPU from the sources requirements-llama.txt pins:

    python -m benchmarks.llama_cpp_build flags          # the CMake flags this CPU gets
    python -m benchmarks.llama_cpp_build wheel DIR      # llama-cpp-python's wheel (~12 min once)
    python -m benchmarks.llama_cpp_build tools DIR      # llama-server and llama-bench (~10 min once)

Each prints the path of what it built (or found built before) on its last line.

Which flags: the machine's own vector instructions (GGML_NATIVE) everywhere but on a CPU
with AMX. There llama.cpp's AMX path crashes on q8_0 and q4_0 weights (llama.cpp issue
20824: llama-cpp-python built natively segfaults on the bundled model's q8_0 GGUF, and
llama-bench on any q8_0/q4_0 file), so the build names the CPU's AVX2 / AVX-512 / VNNI /
BF16 instructions one by one, with the three AMX options off.

Why a folder of our own and not pip's cache: pip keys a wheel it built on the source's
name and hash, not on CMAKE_ARGS, so a wheel built natively would be reused by a build
that asked for AMX off (and one built on another CPU could hold instructions this one
lacks). Here each build lives under DIR/<key>, the key a hash of the version, the flags
and the CPU's instruction set: a build made another way is never picked up.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from plumbing.cli import ArgumentParser
from plumbing.script import UserError, run

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("llama-server", "llama-bench")

# /proc/cpuinfo's flag -> the ggml option that compiles for it, when the build is not native
GGML_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
                "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
                "avx512vbmi": "GGML_AVX512_VBMI"}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def pinned_version():
    """The llama-cpp-python version requirements-llama.txt pins (its vendored llama.cpp)."""
    for line in (ROOT / "requirements-llama.txt").read_text().splitlines():
        if line.startswith("llama-cpp-python=="):
            return line.split("==")[1].strip()
    raise UserError("requirements-llama.txt pins no llama-cpp-python version")


def cpu_flags(cpuinfo=Path("/proc/cpuinfo")):
    """The instruction-set flags of this CPU (the first 'flags' line of /proc/cpuinfo)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_flags(flags):
    """The ggml CMake flags for a CPU with these instruction-set flags."""
    if not flags & {"amx_tile", "amx_int8", "amx_bf16"}:
        return ["-DGGML_NATIVE=ON"]
    named = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in GGML_OPTIONS.items()]
    return ["-DGGML_NATIVE=OFF", *named, *(f"-D{option}=OFF" for option in AMX_OPTIONS)]


def build_folder(parent, what, flags):
    """parent/<what>-<version>-<key>: the key changes with the flags and the CPU's instructions."""
    version, cmake = pinned_version(), cmake_flags(flags)
    key = hashlib.sha256("\n".join([what, version, *cmake, *sorted(flags)]).encode()).hexdigest()[:16]
    return Path(parent).expanduser() / f"{what}-{version}-{key}", cmake


def build_wheel(parent, flags):
    """llama-cpp-python's wheel built with cmake_flags(flags), once; returns its path."""
    folder, cmake = build_folder(parent, "wheel", flags)
    wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    if wheels:
        return wheels[-1]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        # --no-cache-dir: pip's cache may hold a wheel built with other flags (see above)
        env = {**os.environ, "CMAKE_ARGS": " ".join(cmake)}
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
                        "--no-binary", "llama-cpp-python", "-w", scratch,
                        f"llama-cpp-python=={pinned_version()}"], check=True, env=env)
        built = sorted(Path(scratch).glob("llama_cpp_python-*.whl"))
        if not built:
            raise UserError("pip built no llama-cpp-python wheel")
        folder.mkdir(exist_ok=True)
        return built[-1].rename(folder / built[-1].name)  # in the folder only once complete


def build_tools(parent, flags):
    """llama-server and llama-bench from the pinned sources, once; returns their folder."""
    folder, cmake = build_folder(parent, "tools", flags)
    if all((folder / tool).is_file() for tool in TOOLS):
        return folder
    version = pinned_version()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        scratch = Path(scratch)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(scratch)], check=True)
        subprocess.run(["tar", "xzf", str(scratch / f"llama_cpp_python-{version}.tar.gz"),
                        "-C", str(scratch)], check=True)
        source = scratch / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        subprocess.run(["cmake", "-S", str(source), "-B", str(source / "build"), "-DLLAMA_CURL=OFF",
                        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", *cmake], check=True)
        subprocess.run(["cmake", "--build", str(source / "build"), "--target", *TOOLS,
                        "-j", str(os.cpu_count() or 2)], check=True)
        staging = scratch / "tools"
        staging.mkdir()
        for tool in TOOLS:
            (source / "build" / "bin" / tool).rename(staging / tool)
        staging.rename(folder)  # whole or not at all: a build cut short leaves nothing behind
    return folder


def main():
    p = ArgumentParser(description="Build llama.cpp (the peer) for this CPU from the pinned sources; "
                       "AMX off where the CPU has it (see the module docstring).")
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("flags", help="print the CMake flags this CPU gets")
    for name, what in (("wheel", "llama-cpp-python's wheel"), ("tools", "llama-server and llama-bench")):
        s = sub.add_parser(name, help=f"build {what} under DIR (once per flags and CPU); print its path")
        s.add_argument("dir", metavar="DIR", help="the parent folder of the builds")
    args = p.parse_args()
    flags = cpu_flags()
    if args.action == "flags":
        print(" ".join(cmake_flags(flags)))
    elif args.action == "wheel":
        print(build_wheel(args.dir, flags))
    else:
        print(build_tools(args.dir, flags))


if __name__ == "__main__":
    run(main)
