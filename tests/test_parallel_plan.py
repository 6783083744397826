"""memory_plan.py past one machine: the cache and weights of one rank under tensor and
pipeline parallelism. Exact integer arithmetic, so the checks are equalities."""

import subprocess
import sys

import pytest

from kv_quant import cache_bytes
from memory_plan import NAMED, Ranks, rank_shape, rank_weight_bytes
from plumbing.memory import weight_bytes

LLAMA3_8B = next(s for s in NAMED if s.name.startswith("Llama-3-8B"))  # 32 query / 8 kv heads
GPT2_SMALL = next(s for s in NAMED if s.name == "GPT-2 small")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_splits_the_cache_by_heads(tp):
    # S_cache / TP per rank while every rank has a whole key/value head of its own
    rank = rank_shape(LLAMA3_8B, Ranks(tp=tp))
    assert cache_bytes(rank, 4096) * tp == cache_bytes(LLAMA3_8B, 4096)


def test_more_ranks_than_kv_heads_copy_a_head_per_rank():
    # 16 ranks, 8 key/value heads: a head cannot be split, each rank caches one
    assert rank_shape(LLAMA3_8B, Ranks(tp=16)).n_kv_head == 1
    assert cache_bytes(rank_shape(LLAMA3_8B, Ranks(tp=16)), 4096) == cache_bytes(
        rank_shape(LLAMA3_8B, Ranks(tp=8)), 4096)


def test_pipeline_parallel_splits_the_layers():
    assert rank_shape(LLAMA3_8B, Ranks(pp=4)).n_layer == 8
    assert rank_shape(GPT2_SMALL, Ranks(pp=5)).n_layer == 3  # 12 layers: the heaviest stage holds 3


@pytest.mark.parametrize("weights_dtype", ["bfloat16", "int4"])
def test_weights_per_rank_add_up_to_the_model(weights_dtype):
    whole = weight_bytes(LLAMA3_8B.config, weights_dtype)
    assert rank_weight_bytes(LLAMA3_8B, weights_dtype, Ranks(tp=4)) == whole // 4
    # two stages of an untied model: each holds half the blocks and one of the two tables
    assert rank_weight_bytes(LLAMA3_8B, weights_dtype, Ranks(pp=2)) * 2 == pytest.approx(whole, rel=1e-6)


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        rank_shape(LLAMA3_8B, Ranks(tp=3))


def test_command_prints_per_rank_and_refuses_a_split_of_the_model_it_was_given():
    out = subprocess.run([sys.executable, "memory_plan.py", "--tensor-parallel", "2", "--json"],
                         capture_output=True, text=True, check=True)
    assert '"tensor_parallel": 2' in out.stdout
    assert "left out: GPT-2 xl: 25 query heads" in out.stderr  # a shape it was not given: skipped
    bad = subprocess.run([sys.executable, "memory_plan.py", "--tensor-parallel", "3",
                          "--ckpt", "checkpoints/shakespeare/ckpt.pt"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "bundled model: 4 query heads do not split evenly over 3 ranks (--tensor-parallel 3" in bad.stderr
