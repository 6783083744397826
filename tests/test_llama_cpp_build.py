"""benchmarks/llama_cpp_build.py: the peer's build flags follow the CPU (AMX off where it has
AMX, llama.cpp issue 20824), and a build made with other flags or on another CPU is never
picked up (each lives in a folder keyed by both)."""

from pathlib import Path

from benchmarks.llama_cpp_build import build_folder, cmake_flags, cpu_flags

EPYC = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx512_bf16"}
XEON_AMX = EPYC | {"avx512vbmi", "amx_tile", "amx_int8", "amx_bf16"}


def test_a_cpu_without_amx_gets_the_native_build():
    assert cmake_flags(EPYC) == ["-DGGML_NATIVE=ON"]
    assert cmake_flags({"sse2"}) == ["-DGGML_NATIVE=ON"]


def test_a_cpu_with_amx_names_its_instructions_and_turns_amx_off():
    flags = cmake_flags(XEON_AMX)
    assert flags[0] == "-DGGML_NATIVE=OFF"
    for on in ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX512_VBMI", "FMA", "F16C"):
        assert f"-DGGML_{on}=ON" in flags
    assert "-DGGML_AVX_VNNI=OFF" in flags  # not in this CPU's flags
    for amx in ("AMX_TILE", "AMX_INT8", "AMX_BF16"):
        assert f"-DGGML_{amx}=OFF" in flags
        assert f"-DGGML_{amx}=ON" not in flags


def test_builds_for_other_flags_or_cpus_live_apart(tmp_path):
    epyc, _ = build_folder(tmp_path, "wheel", EPYC)
    epyc_again, _ = build_folder(tmp_path, "wheel", set(EPYC))
    xeon, _ = build_folder(tmp_path, "wheel", XEON_AMX)
    avx2_only, _ = build_folder(tmp_path, "wheel", {"avx", "avx2", "fma"})  # native too, other CPU
    tools, _ = build_folder(tmp_path, "tools", EPYC)
    assert epyc == epyc_again
    assert len({epyc, xeon, avx2_only, tools}) == 4
    assert all(p.parent == tmp_path for p in (epyc, xeon, avx2_only, tools))


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile\nflags\t\t: other\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_tile"}
    assert cpu_flags(Path(tmp_path / "missing")) == set()
