"""``bench.engines.ar_step_profile`` on vLLM's CPU build (run in ``.venv-vllm``): every loop
(vLLM's own, with and without the sampled logprob; vLLM's engine core alone; ours, with and
without) decodes the same
greedy tokens, and the results file has a point per loop with its ms per step and GPU-wait share."""
from __future__ import annotations

import json

from bench.engines import ar_step_profile


def test_the_profile_runs_every_loop_and_their_greedy_outputs_agree(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MINEDRAFT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "profile" / "ar_profile.json"
    assert ar_step_profile.main(["--device", "cpu", "--dtype", "float32", "--target", "random:tiny-llama-hd64",
                                 "--batch-sizes", "2", "--num-tokens", "8", "--decode-steps", "4",
                                 "--prompt-len", "12", "--max-model-len", "128", "--enforce-eager",
                                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["greedy_equal"] == {"2": True}
    assert [p["loop"] for p in result["points"]] == list(ar_step_profile.LOOPS)
    assert all(p["ms_per_step"] > 0 and 0 <= p["gpu_wait_share"] <= 1 for p in result["points"])
    assert (tmp_path / "profile" / "ar_profile_ours_b2.txt").is_file()
