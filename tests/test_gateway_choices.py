"""``n`` > 1 and ``best_of`` over gRPC (issue 25): a real ``python -m gateway`` in front of the fake
coordinator (tests/test_gateway.py's ``stack``; its ``is_seeded_sampling`` makes a sampled request's
tokens and logprobs a function of its seed).

Checked: each sample is its own coordinator request (``<id>#<i>``, seed + i); greedy n = 2 gives two
choices equal to n = 1; seeded n = 3 is reproducible and its choices differ; chunks and completes
carry their choice index; best_of returns the n with the highest cumulative logprob; a cancel or
an Abort of the parent aborts every child and frees the ids; a failed child fails the request and
aborts the others; validation names ``n`` / ``best_of`` (with a configurable ``max_n``).
"""
from __future__ import annotations

import time

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.tokenizer import PromptTokenizer
from gateway.validation import InvalidRequestError, prepare_request
from minedraft.client import GenerationError, MineDraftClient, build_request
from test_gateway import stack  # noqa: F401  (module fixture: gateway subprocess, fake coordinator)

TEXT = " The quick brown fox"


@pytest.fixture
def fake(stack, tokenizer):  # noqa: F811
    fake, _ = stack
    fake.script = [[i] for i in tokenizer.encode(TEXT, add_special_tokens=False)]
    fake.step_delay_s, fake.is_seeded_sampling, fake.error_ids = 0.0, True, set()
    yield fake
    fake.is_seeded_sampling, fake.error_ids = False, set()


@pytest.fixture
def client(stack):  # noqa: F811
    with MineDraftClient(f"127.0.0.1:{stack[1]}", timeout_s=30) as c:
        yield c


def _sent(fake, request_id: str) -> list:
    return [r for r in fake.requests if r.request_id.split("#")[0] == request_id]


def _wait_aborted(fake, ids: list[str]) -> None:
    deadline = time.monotonic() + 10
    while not set(ids) <= set(fake.aborted) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(ids) <= set(fake.aborted), fake.aborted[-5:]


def test_greedy_n2_gives_two_choices_equal_to_n1(client, fake):
    one = client.generate("hi", max_tokens=8, temperature=0, request_id="g1")
    two = client.generate_choices("hi", max_tokens=8, temperature=0, request_id="g2", n=2)
    assert [r.text for r in two] == [one.text, one.text] == [TEXT] * 2
    assert [r.token_ids for r in two] == [one.token_ids] * 2
    assert sorted(r.request_id for r in _sent(fake, "g2")) == ["g2#0", "g2#1"]
    assert [r.usage.prompt_tokens for r in two] == [one.usage.prompt_tokens] * 2


def test_seeded_n3_is_reproducible_and_its_choices_differ(client, fake):
    first = client.generate_choices("hi", max_tokens=8, temperature=1.0, seed=7, n=3, request_id="s1")
    again = client.generate_choices("hi", max_tokens=8, temperature=1.0, seed=7, n=3, request_id="s2")
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in first}) == 3
    assert sorted(r.sampling.seed for r in _sent(fake, "s1")) == [7, 8, 9]  # seed + i


def test_stream_chunks_and_completes_carry_their_choice_index(client, fake):
    responses = list(client.stream(build_request("hi", max_tokens=8, temperature=0, n=3, request_id="idx")))
    assert all(r.request_id == "idx" for r in responses)
    for index in range(3):
        mine = [r for r in responses if getattr(r, r.WhichOneof("response")).index == index]
        kinds = [r.WhichOneof("response") for r in mine]
        assert kinds[-1] == "complete" and kinds.count("complete") == 1 and "chunk" in kinds, kinds
        assert "".join(r.chunk.text for r in mine if r.HasField("chunk")) == TEXT
    assert responses[-1].WhichOneof("response") == "complete"


def test_best_of_returns_the_n_with_the_highest_cumulative_logprob(client, fake):
    # seeds 7..10: logprob per token -0.1 * (1 + seed % 5) -> seed 10 best, then 7, 8, 9
    best = client.generate_choices("hi", max_tokens=8, temperature=1.0, seed=7, n=2, best_of=4, request_id="b")
    singles = {s: client.generate("hi", max_tokens=8, temperature=1.0, seed=s, request_id=f"b-{s}") for s in (10, 7)}
    assert [r.token_ids for r in best] == [singles[10].token_ids, singles[7].token_ids]
    assert len(_sent(fake, "b")) == 4
    responses = list(client.stream(build_request("hi", max_tokens=8, temperature=1.0, seed=7, n=1, best_of=3)))
    assert {getattr(r, r.WhichOneof("response")).index for r in responses} == {0}
    assert sum(r.WhichOneof("response") == "complete" for r in responses) == 1


def test_cancel_aborts_every_child_and_frees_the_ids(client, fake):
    fake.step_delay_s = 0.1
    fake.script = fake.script * 10
    stream = client.stream(build_request("hi", max_tokens=40, temperature=0, n=3, request_id="c"))
    assert next(stream).WhichOneof("response") == "chunk"
    stream.close()
    _wait_aborted(fake, ["c#0", "c#1", "c#2"])
    fake.step_delay_s = 0.0
    assert len(client.generate_choices("hi", max_tokens=4, temperature=0, n=3, request_id="c")) == 3  # ids free


def test_abort_of_the_parent_aborts_every_child(client, fake):
    fake.step_delay_s = 0.2
    fake.script = fake.script * 10
    stream = client.stream(build_request("hi", max_tokens=40, temperature=0, n=2, request_id="a"))
    assert next(stream).WhichOneof("response") == "chunk"
    assert client.abort("a") is True
    _wait_aborted(fake, ["a#0", "a#1"])
    finishes = [r.complete.finish_reason for r in stream if r.HasField("complete")]
    assert finishes == ["abort", "abort"]


def test_a_failed_child_fails_the_request_and_aborts_the_others(client, fake):
    fake.step_delay_s = 0.1
    fake.script = fake.script * 10
    fake.error_ids = {"f#1"}
    with pytest.raises(GenerationError, match="child failed"):
        client.generate_choices("hi", max_tokens=40, temperature=0, n=3, request_id="f")
    _wait_aborted(fake, ["f#0", "f#2"])


def test_a_child_id_in_flight_is_refused(client, fake):
    fake.step_delay_s = 0.2
    fake.script = fake.script * 10
    stream = client.stream(build_request("hi", max_tokens=40, temperature=0, n=2, request_id="p"))
    assert next(stream).WhichOneof("response") == "chunk"
    with pytest.raises(grpc.RpcError) as info:
        client.generate("hi", max_tokens=2, request_id="p#1")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in info.value.details()
    stream.close()


def test_max_n_is_configurable(tokenizer_dir):
    tokenizer, cfg = PromptTokenizer(tokenizer_dir), GatewayConfig(tokenizer=tokenizer_dir, max_n=4)
    assert prepare_request(build_request("hi", n=4), tokenizer, cfg).best_of == 4
    assert prepare_request(build_request("hi", n=2, best_of=3), tokenizer, cfg).n == 2
    for n, best_of, field in ((5, 0, "n"), (2, 5, "best_of"), (3, 2, "best_of")):
        with pytest.raises(InvalidRequestError) as info:
            prepare_request(build_request("hi", n=n, best_of=best_of), tokenizer, cfg)
        assert info.value.field == field and str(info.value).startswith(f"{field}: must be in ["), info.value
