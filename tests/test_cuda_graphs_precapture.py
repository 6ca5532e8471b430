"""Warm-up precapture of every static shape (specdec.engine.cuda_graphs.StaticStepper.precapture).

On the CPU twin precapture enumerates the same (batch bucket, tokens per row, KV bucket) shapes
that the CUDA path captures; a full static/dynamic drive must then use only precaptured shapes,
and an eager precapture (scratch-slot writes only) must not change any step's logits or KV.
"""

from __future__ import annotations

import pytest
import torch
from test_cuda_graphs import CACHE, DYNAMIC, STATIC, _drive

from specdec.config import ModelConfig
from specdec.engine.cuda_graphs import batch_buckets, kv_buckets
from specdec.engine.runner import ModelRunner


def _static_runner(tiny_llama, run_eager: bool):
    runner = ModelRunner(STATIC, CACHE, model=tiny_llama(num_layers=2, dtype=torch.float64))
    stepper = runner.static_stepper
    assert stepper is not None and not stepper.use_graphs
    assert not stepper.precaptured_shapes                  # the CPU twin does not precapture itself
    count, seconds = stepper.precapture(run_eager=run_eager)
    assert seconds >= 0
    num_q = STATIC.max_static_tokens
    assert count == len(batch_buckets(CACHE.max_num_seqs)) * num_q * len(kv_buckets(160))
    return runner


@pytest.mark.parametrize("run_eager", [False, True])
def test_drive_uses_only_precaptured_shapes_and_outputs_unchanged(tiny_llama, run_eager):
    torch.set_num_threads(1)
    static = _static_runner(tiny_llama, run_eager)
    dynamic = ModelRunner(DYNAMIC, CACHE, model=tiny_llama(num_layers=2, dtype=torch.float64))
    stepper = static.static_stepper
    before = set(stepper.precaptured_shapes)
    _drive(static, dynamic, static.vocab_size)             # logits and KV equal the dynamic path
    assert stepper.used_shapes and stepper.used_shapes <= before
    assert {q for _, q, _ in stepper.used_shapes} >= {1, 5}   # decode and verify widths
    assert len({kv for _, _, kv in stepper.used_shapes}) == 2
    assert stepper.precaptured_shapes == before            # nothing new appeared mid-run


def test_all_shapes_cover_every_width_and_bucket(tiny_llama):
    stepper = ModelRunner(STATIC, CACHE, model=tiny_llama(num_layers=1)).static_stepper
    shapes = stepper.all_shapes()
    assert len(shapes) == len(set(shapes))
    assert {b for b, _, _ in shapes} == set(batch_buckets(CACHE.max_num_seqs))
    assert {q for _, q, _ in shapes} == set(range(1, STATIC.max_static_tokens + 1))
    assert {kv for _, _, kv in shapes} == set(kv_buckets(CACHE.max_model_len))


def test_precapture_flag_default_on():
    assert ModelConfig().cuda_graph_precapture is True
    assert ModelConfig(cuda_graph_precapture=False).cuda_graph_precapture is False
