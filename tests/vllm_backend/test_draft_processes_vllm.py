"""``drafter_svc.processes.DraftProcesses`` over two vLLM session drafters on vLLM's CPU build (run
in ``.venv-vllm``), built as the drafter builds them with ``--engine vllm --draft-sessions
--draft-processes 2``: the rows of a call go to their home processes side by side, and the merged
drafts are the draft model's greedy continuation (Hugging Face reference) call after call."""
from __future__ import annotations

from drafter_svc.__main__ import parse_args
from drafter_svc.processes import DraftProcesses
from drafter_svc.worker import process_builds
from specdec.sample.sampling import SamplingParams
from test_draft_sessions import _hf_greedy, model  # noqa: F401 -- model: the tiny draft fixture

GREEDY = SamplingParams(temperature=0.0, seed=0)


def test_two_vllm_session_drafters_draft_the_greedy_continuation(model):
    path, hf = model
    args = parse_args(["--engine", "vllm", "--draft-sessions", "--draft", path, "--device", "cpu", "--dtype",
                       "float32", "--enforce-eager", "--max-num-seqs", "4", "--max-model-len", "256",
                       "--kv-cache-space-gib", "0.1", "--draft-processes", "2"])
    processes = DraftProcesses(process_builds(args), log_level="WARNING")
    try:
        assert processes.num_processes == 2 and processes.facts().max_num_seqs == 4
        assert processes.can_draft(253, 3) and not processes.can_draft(254, 3)   # vLLM's rule: committed + k
        ids = ["a", "b", "c"]
        sequences = [[3 + (5 * i + j) % 120 for j in range(6 + 3 * i)] for i in range(3)]
        processes.add_requests([(rid, seq, GREEDY) for rid, seq in zip(ids, sequences)])
        assert sorted(processes._home.values()) == [0, 0, 1]
        committed = [(0, list(seq)) for seq in sequences]
        for call in range(3):
            drafts, probs = processes.draft(ids, committed, 3)
            assert probs is None   # vLLM's drafters send token ids only
            assert drafts == [_hf_greedy(hf, seq, 3) for seq in sequences]
            # the verifier kept drafts[:call] of each row and added a token of its own
            committed = [(len(seq), row[:call] + [7]) for seq, row in zip(sequences, drafts)]
            sequences = [seq + tokens for seq, (_, tokens) in zip(sequences, committed)]
        for rid in ids:
            processes.release(rid)
        assert processes.facts().num_free_slots == 4
    finally:
        processes.close()
