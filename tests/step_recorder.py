"""A multi-step ``decode`` call with its ``on_step`` outputs recorded (tests of rows that end
inside a call: tests/test_decode_row_ends.py, tests/vllm_backend/test_row_ends.py)."""
from __future__ import annotations


def decode_recorded(worker, request_ids, num_steps: int, max_steps=None):
    """(tokens by request id, per id the 1-based steps of its ``on_step`` outputs, per id the
    steps whose output was flagged ``is_final``) of ``worker.decode(request_ids, num_steps, ...)``."""
    seen, final, step_no = {}, {}, [0]

    def on_step(steps):
        step_no[0] += 1
        for s in steps:
            seen.setdefault(s.request_id, []).append(step_no[0])
            if s.is_final:
                final.setdefault(s.request_id, []).append(step_no[0])

    outs = worker.decode(list(request_ids), num_steps, on_step, max_steps)
    return {o.request_id: list(o.token_ids) for o in outs}, seen, final
