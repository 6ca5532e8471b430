"""coordinator.streamed: what a streamed call's partial messages committed, the whole response's
rest (named and joined rows), and the tokens held until a joined request's first token."""
from __future__ import annotations

from coordinator.streamed import EarlyTokens, StreamedTokens, after_streamed
from minedraft.v1 import engine_pb2


def _out(rid: str, tokens: list[int]) -> engine_pb2.SeqOutput:
    return engine_pb2.SeqOutput(request_id=rid, token_ids=tokens, logprobs=[-float(t) for t in tokens])


def test_the_rest_of_a_whole_response_skips_what_the_partials_brought() -> None:
    streamed = StreamedTokens()
    streamed.add("a", 2)
    streamed.add("a", 1)
    assert streamed.rest(_out("a", [1, 2, 3, 4, 5]))[:2] == ([4, 5], [-4.0, -5.0])
    assert streamed.rest(_out("b", [7]))[0] == [7]     # nothing streamed: all of it
    rest = after_streamed(_out("a", [1, 2, 3, 4]), streamed)
    assert rest.request_id == "a" and list(rest.token_ids) == [4] and list(rest.logprobs) == [-4.0]
    assert list(after_streamed(_out("a", [1, 2, 3]), streamed).token_ids) == []


def test_early_tokens_are_held_only_while_the_first_token_is_due_and_come_back_in_order() -> None:
    early = EarlyTokens()
    assert not early.hold(_out("a", [1]))             # no admission under way: commit it now
    early.start(["a", "b"])
    assert early.hold(_out("a", [2])) and early.hold(_out("a", [3, 4])) and early.hold(_out("b", [9]))
    assert [list(o.token_ids) for o in early.take("a")] == [[2], [3, 4]]
    assert not early.hold(_out("a", [5]))             # its first token is committed: later ones go at once
    assert early.take("a") == []
    assert [list(o.token_ids) for o in early.take("b")] == [[9]]   # a failed admission drops these
    assert early.take("b") == [] and not early.hold(_out("b", [10]))
