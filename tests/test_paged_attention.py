"""The hand-written paged attention kernel (serving/paged_attention.cpp) against the
PyTorch one it stands in for (decode_attention): the same outputs over a pool read through
its views, with every head layout the models have, and padding never read; and its build
(plumbing/kernel_build.py): the PyTorch kernel where it cannot be built, and a build killed
midway blocking no later load.

Tolerance 1e-5: both compute in float32, the C++ in another order (a running softmax, its
partial sums scaled as the maximum grows); the outputs are averages of values of order 1,
where a column read wrongly or a scale missed moves them by ~1e-1."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from kv_quant import head_bytes, storage_format
from plumbing.kernel_build import build_directory, build_kernel, library_name
from serving.paged_attention import decode_attention, hand_written_kernel


@pytest.fixture(scope="module")
def kernel():
    built = hand_written_kernel()  # the first run on a machine compiles it (~15-30 s)
    assert built is not decode_attention, "the kernel did not build: a C++ compiler is needed"
    return built


def pool_and_reads(n_head, n_kv_head, seed, batch=3, columns=13, head_dim=16, slots=48):
    """A two-layer pool (layers, k/v, slots, n_kv_head, hd) and what a step of `batch`
    sequences reads from its second layer: q, each column's slot (distinct, in no order),
    and visible (batch, columns) with padding at the left and hidden columns inside."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, slots, n_kv_head, head_dim, generator=g)
    q = torch.randn(batch, n_head, 1, head_dim, generator=g)
    read_slots = torch.randperm(slots, generator=g)[:batch * columns].view(batch, columns)
    visible = torch.rand(batch, columns, generator=g) > 0.3
    visible[:, -1] = True          # each sequence sees at least its newest column
    visible[0, :5] = False         # left padding
    return q, kv, read_slots, visible


@pytest.mark.parametrize("n_head, n_kv_head", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_the_hand_written_kernel_gives_decode_attentions_outputs(kernel, n_head, n_kv_head):
    q, kv, read_slots, visible = pool_and_reads(n_head, n_kv_head, seed=n_head + n_kv_head)
    k_pool, v_pool = kv[1, 0], kv[1, 1]  # views into the pool, as the step passes them
    expected = decode_attention(q, k_pool, v_pool, read_slots, visible)
    got = kernel(q, k_pool, v_pool, read_slots, visible)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_the_hand_written_kernel_never_reads_a_hidden_column(kernel):
    # NaN in every hidden column's key and value: a kernel that reads one, even to weigh
    # it by zero, gives NaN
    q, kv, read_slots, visible = pool_and_reads(4, 2, seed=3)
    expected = decode_attention(q, kv[1, 0], kv[1, 1], read_slots, visible)
    kv[1, :, read_slots[~visible]] = float("nan")
    got = kernel(q, kv[1, 0], kv[1, 1], read_slots, visible)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_dtype, head_dim", [("int8", 16), ("int4", 16), ("int4", 64)])
@pytest.mark.parametrize("n_head, n_kv_head", [(4, 4), (6, 1)], ids=["mha", "mqa"])
def test_a_quantized_pool_is_read_as_its_dequantized_values(kernel, kv_dtype, head_dim, n_head, n_kv_head):
    """A pool of kv_quant's codes and scales, read in place by both kernels, gives what the
    float kernel gives over the same pool dequantized (int4 at head_dim 64: two scales a
    head, and channels i and i + 32 in one byte). Same tolerance: the codes are exact, the
    sums in another order; a scale misread moves the outputs by far more."""
    q, kv, read_slots, visible = pool_and_reads(n_head, n_kv_head, seed=7, head_dim=head_dim)
    fmt = storage_format(kv_dtype, head_dim, torch.float32)
    stored = fmt.encode(kv[1])                                   # (2, slots, n_kv_head, head_bytes)
    assert stored.dtype == torch.uint8 and stored.size(-1) == head_bytes(head_dim, kv_dtype)
    dequantized = fmt.decode(stored)
    expected = decode_attention(q, dequantized[0], dequantized[1], read_slots, visible)
    in_place = decode_attention(q, stored[0], stored[1], read_slots, visible, fmt)
    torch.testing.assert_close(in_place, expected, atol=1e-5, rtol=0)
    got = kernel(q, stored[0], stored[1], read_slots, visible, fmt)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # and the codes are not the floats they stand for: the test can tell a format misread
    assert (decode_attention(q, kv[1, 0], kv[1, 1], read_slots, visible) - expected).abs().max() > 1e-4


def test_the_hand_written_kernel_refuses_a_slot_outside_the_pool(kernel):
    # the PyTorch kernel's indexing raises; C++ would read past the pool without the check
    q, kv, read_slots, visible = pool_and_reads(4, 4, seed=5)
    read_slots[1, 2] = kv.size(2)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel(q, kv[1, 0], kv[1, 1], read_slots, visible)


def test_without_the_tools_to_build_it_the_step_keeps_the_pytorch_kernel(tmp_path):
    # no ninja and no compiler on the PATH, an empty build cache: one warning, the PyTorch kernel
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from serving.paged_attention import decode_attention, hand_written_kernel\n"
            "print(hand_written_kernel() is decode_attention)")
    env = {**os.environ, "PATH": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]
    warning = [line for line in proc.stderr.splitlines() if "could not be built" in line]
    assert len(warning) == 1 and "using decode_attention" in warning[0]


def test_a_build_killed_midway_does_not_stop_the_next_load(kernel):
    # torch's lock file, as a build killed with -9 leaves it: torch alone would wait for it
    # forever (tried: a server that never starts); the next load goes ahead
    directory = build_directory(library_name("kvcache_gpt_paged_attention"))
    (directory / "lock").touch()
    code = ("from serving.paged_attention import decode_attention, hand_written_kernel\n"
            "print(hand_written_kernel() is not decode_attention)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"] and not (directory / "lock").exists()



def test_an_unsafe_build_folder_or_a_planted_lock_link_is_refused_in_one_line(tmp_path, monkeypatch):
    # the folder holds a library that is loaded and run: one anyone may write could hold a
    # library planted there, so nothing is built or loaded from it (the PyTorch kernel
    # serves instead); a link at the lock's name is not followed (it would truncate its target)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = build_directory(library_name("k"))
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o777)
    assert "writable by its group or others" in build_kernel(ROOT / "missing.cpp", "k")
    folder.chmod(0o700)
    target = tmp_path / "precious"
    target.write_text("keep me")
    (folder / "kvcache_gpt.lock").symlink_to(target)
    error = build_kernel(ROOT / "missing.cpp", "k")
    assert error is not None and "\n" not in error
    assert target.read_text() == "keep me"
