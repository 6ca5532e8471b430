"""Start-up memory check (specdec.models.footprint): footprints equal the allocated sizes; too big fails at start."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specdec.models.footprint import Footprint, InsufficientMemoryError, check_fits, model_footprint

MAX_NUM_SEQS, MAX_MODEL_LEN = 3, 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import _build_tiny_llama

    path = str(tmp_path_factory.mktemp("tiny"))
    _build_tiny_llama().save_pretrained(path, safe_serialization=True)
    return path


def test_footprint_equals_what_the_runner_allocates(model_dir):
    from specdec.config import CacheConfig, ModelConfig
    from specdec.engine.runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner(ModelConfig(model=model_dir), CacheConfig(max_num_seqs=MAX_NUM_SEQS,
                                                                         max_model_len=MAX_MODEL_LEN))
    footprint = model_footprint("target", model_dir, "float32", MAX_NUM_SEQS, MAX_MODEL_LEN)
    assert (footprint.weight_bytes, footprint.kv_cache_bytes) == (runner.weight_bytes, runner.kv_cache_bytes)
    half = model_footprint("target", model_dir, "bfloat16", MAX_NUM_SEQS, MAX_MODEL_LEN)
    assert 2 * half.total_bytes == footprint.total_bytes


def test_check_fits_names_every_part_when_it_cannot_fit():
    parts = [Footprint("target", 3 * 1024**3, 1024**3), Footprint("draft", 1024**3, 1024**3)]
    assert check_fits(parts, available=6 * 1024**3) == 6 * 1024**3
    with pytest.raises(InsufficientMemoryError, match=r"draft KV cache 1.00 GiB = 6.00 GiB > 5.00 GiB available"):
        check_fits(parts, available=5 * 1024**3)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Footprint("draft", 0, -1)


def test_drafter_too_big_for_memory_fails_at_start_with_a_clear_message(model_dir):
    """A draft KV cache of ~10^6 slots cannot fit: the drafter exits 1 before allocating anything."""
    proc = subprocess.run([sys.executable, "-m", "drafter_svc", "--draft", model_dir, "--port", "0",
                           "--max-num-seqs", "1000000", "--max-model-len", "4096"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "not enough memory: draft weights" in proc.stderr and "draft KV cache" in proc.stderr


def test_stack_that_cannot_fit_fails_before_starting_anything(model_dir, tmp_path):
    from minedraft.launcher import Stack
    from minedraft.stack import StackConfig

    stack = Stack(StackConfig(mode="sd", target=model_dir, draft=model_dir, max_num_seqs=500_000,
                              max_model_len=4096, runs_dir=str(tmp_path)))
    with pytest.raises(InsufficientMemoryError, match="target KV cache .* draft KV cache"):
        stack.start(model_dir, log=lambda line: None)
    assert stack.services == []
