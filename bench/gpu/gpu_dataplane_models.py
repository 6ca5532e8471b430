"""Random-weight Llama targets of real models' shapes and the timed verify step for
``bench/gpu/gpu_dataplane.py`` (no weights are downloaded: shapes only, weights ~ N(0, 0.02)).

``time_verify_steps`` times ``specdec.engine.worker.TargetWorker.verify`` (the verifier's real step:
slot-KV forward of b x (k + 1) tokens, rejection sampling against draft probs, commit) in eager
mode; k = 0 is a plain decode step.
"""

from __future__ import annotations

import statistics
import time

import torch

# shapes of HuggingFaceTB/SmolLM2-135M-Instruct and meta-llama/Llama-3.1-8B (config.json)
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
}
_WARMUP = 2
_FIRST_WARMUP = 30  # a model's first ~30 steps paid start-up costs (seen: 8B b=4 k<=2 p90 80-386 ms)
_SEED = 0


def build_random_llama(name: str, device: str, dtype: torch.dtype = torch.bfloat16, num_layers: int | None = None):
    """``LlamaForCausalLM`` of preset ``name``'s shapes with seeded random weights, on ``device``.

    Raises:
        KeyError: unknown preset.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(PRESETS[name])
    rope_theta = shape.pop("rope_theta")
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    config = LlamaConfig(**shape, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    torch.manual_seed(_SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_verify_steps(models: list[str], batches: list[int], ks: list[int], device: str,
                      context_len: int, iters: int) -> list[dict]:
    """Rows {model, b, k, verify_ms (median), verify_p90_ms, num_iters}; k = 0 rows are decode."""
    from specdec.config import CacheConfig, ModelConfig
    from specdec.engine.runner import ModelRunner
    from specdec.sample.sampling import SamplingParams
    from specdec.engine.worker import TargetWorker

    rows = []
    all_ks = [0, *ks]
    max_model_len = context_len + (len(all_ks) * (iters + _WARMUP) + _FIRST_WARMUP) * (max(all_ks) + 1) + 8
    for name in models:
        model = build_random_llama(name, device)
        runner = ModelRunner(ModelConfig(model=f"random:{name}", dtype="bfloat16", device=device),
                             CacheConfig(max_num_seqs=max(batches), max_model_len=max_model_len), model=model)
        worker = TargetWorker(runner, seed=_SEED)
        gen = torch.Generator().manual_seed(_SEED)
        vocab = runner.vocab_size
        for b in batches:
            ids = [f"{name}-{b}-{i}" for i in range(b)]
            for i, rid in enumerate(ids):
                prompt = torch.randint(3, vocab, (context_len,), generator=gen).tolist()
                worker.add_request(rid, prompt, SamplingParams(temperature=1.0, seed=i))
            for k in all_ks:
                samples = []
                num_warmup = _WARMUP + (_FIRST_WARMUP if b == batches[0] and k == all_ks[0] else 0)
                for it in range(num_warmup + iters):
                    drafts = torch.randint(3, vocab, (b, k), generator=gen).tolist()
                    probs = torch.softmax(torch.randn(b, k, vocab, device=device), -1) if k else None
                    _sync(device)
                    start = time.perf_counter()
                    worker.verify(ids, drafts, probs)
                    _sync(device)
                    if it >= num_warmup:
                        samples.append((time.perf_counter() - start) * 1000.0)
                samples.sort()
                rows.append({"model": name, "b": b, "k": k, "verify_ms": statistics.median(samples),
                             "verify_p90_ms": samples[min(len(samples) - 1, int(0.9 * len(samples)))],
                             "num_iters": len(samples)})
                print(rows[-1], flush=True)
            for rid in ids:
                worker.release(rid)
        del worker, runner, model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows
