"""Gateway tests: a real ``python -m gateway`` process in front of a fake coordinator
(tests/gateway_harness.py): field validation, streaming and usage, chat templates, stop strings,
cancel and abort, malformed and oversized messages. Detokenizer units: test_gateway_detokenizer.py.
"""
from __future__ import annotations

import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from minedraft.client import GenerationError, MineDraftClient, build_request
from minedraft.v1 import common_pb2

from gateway_harness import MAX_MODEL_LEN, MODEL_NAME, FakeCoordinatorThread, _free_port, _health, _wait_until_up


@pytest.fixture(scope="module")
def stack(tokenizer_dir):
    """(fake coordinator, gateway port): gateway health checked NOT_SERVING -> SERVING."""
    fake = FakeCoordinatorThread()
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--tokenizer", tokenizer_dir, "--coordinator", f"127.0.0.1:{fake.port}",
         "--port", str(port), "--model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN), "--grace", "1",
         "--http-port", "0"],   # gRPC only: the default HTTP port 8000 may be taken by another process
        stderr=subprocess.PIPE)
    try:
        _wait_until_up(port, process)
        time.sleep(1.0)  # the gateway watches the coordinator, which is still NOT_SERVING
        assert _health(port) == health_pb2.HealthCheckResponse.NOT_SERVING
        fake.set_serving()
        MineDraftClient(f"127.0.0.1:{port}").wait_until_serving(timeout_s=30)
        yield fake.servicer, port
    finally:
        process.terminate()
        process.wait(timeout=30)
        fake.stop()


@pytest.fixture
def client(stack):
    fake, port = stack
    fake.script, fake.step_delay_s = [], 0.0
    with MineDraftClient(f"127.0.0.1:{port}", timeout_s=30) as c:
        yield c


def _chunks_of(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


BAD_REQUESTS = [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", max_tokens=-1), "sampling.max_tokens"),
    (dict(prompt="hi", max_tokens=MAX_MODEL_LEN + 1), "sampling.max_tokens"),
    (dict(prompt="hi " * 20, max_tokens=MAX_MODEL_LEN - 5), "sampling.max_tokens"),
    (dict(prompt="hi " * MAX_MODEL_LEN), "prompt"),
    (dict(prompt="hi", temperature=-0.1), "sampling.temperature"),
    (dict(prompt="hi", temperature=math.nan), "sampling.temperature"),
    (dict(prompt="hi", top_p=1.5), "sampling.top_p"),
    (dict(prompt="hi", top_p=-0.5), "sampling.top_p"),
    (dict(prompt="hi", top_k=-2), "sampling.top_k"),
    (dict(prompt="hi", min_p=1.5), "sampling.min_p"),
    (dict(prompt="hi", seed=-1), "sampling.seed"),
    (dict(prompt="hi", stop=["a", ""]), "sampling.stop[1]"),
    (dict(prompt="hi", stop=[f"s{i}" for i in range(17)]), "sampling.stop"),
    (dict(prompt="hi", stop_token_ids=[10**6]), "sampling.stop_token_ids[0]"),
    (dict(prompt="hi", stop_token_ids=[1, -1]), "sampling.stop_token_ids[1]"),
    (dict(prompt="hi", model="no-such-model"), "model"),
    (dict(prompt_token_ids=[]), "prompt_token_ids"),
    (dict(prompt_token_ids=[49152]), "prompt_token_ids[0]"),
    (dict(prompt_token_ids=[1, 2, 49152]), "prompt_token_ids[2]"),
    (dict(messages=[]), "messages"),
    (dict(prompt="hi", stop=["x" * 1025]), "sampling.stop[0]"),               # issue 25.4: over-long stop string
    (dict(prompt="hi", presence_penalty=2.5), "sampling.presence_penalty"),
    (dict(prompt="hi", frequency_penalty=-2.5), "sampling.frequency_penalty"),
    (dict(prompt="hi", frequency_penalty=math.nan), "sampling.frequency_penalty"),
    (dict(prompt="hi", repetition_penalty=-0.5), "sampling.repetition_penalty"),
    (dict(prompt="hi", repetition_penalty=math.inf), "sampling.repetition_penalty"),
    (dict(prompt="hi", request_id="r" * 513), "request_id"),             # and request id
]


@pytest.mark.parametrize("kwargs,field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_invalid_field_is_refused_naming_it(client, stack, kwargs, field):
    with pytest.raises(grpc.RpcError) as info:
        client.generate(**kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:"), info.value.details()


@pytest.mark.parametrize("n,best_of,field", [(17, 0, "n"), (-1, 0, "n"), (2, 1, "best_of"), (1, 17, "best_of")])
def test_n_and_best_of_out_of_range_are_refused(client, n, best_of, field):
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(build_request("hi", n=n, best_of=best_of)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:")


def test_stream_usage_and_defaults(client, stack, tokenizer):
    fake, _ = stack
    ids = tokenizer.encode(" The quick brown fox jumps", add_special_tokens=False)
    fake.script = _chunks_of(ids, 2)
    result = client.generate("<|im_end|> hi", request_id="req-defaults")
    sent = fake.requests[-1]
    assert 2 not in sent.prompt_token_ids  # special-token text is tokenized as text
    assert sent.sampling.top_p == 1.0 and sent.sampling.top_k == -1 and sent.sampling.temperature == 0
    assert sent.sampling.max_tokens == MAX_MODEL_LEN - len(sent.prompt_token_ids)
    assert result.text == " The quick brown fox jumps" and result.token_ids == ids
    assert result.finish_reason == "length" and result.num_chunks == len(fake.script)
    assert result.usage.prompt_tokens == len(sent.prompt_token_ids)
    assert result.usage.num_drafts == len(fake.script) - 1
    assert result.usage.completion_tokens == len(ids)


def test_chat_messages_use_the_chat_template(client, stack, tokenizer):
    fake, _ = stack
    fake.script = [tokenizer.encode("ok", add_special_tokens=False)]
    client.generate(messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                             add_generation_prompt=True, tokenize=False)
    assert list(fake.requests[-1].prompt_token_ids) == tokenizer.encode(expected, add_special_tokens=False)


def test_stop_string_split_across_two_chunks(client, stack, tokenizer):
    fake, _ = stack
    ids = tokenizer.encode("Hello world! More text follows here", add_special_tokens=False)
    fake.script = [[i] for i in ids]
    fake.step_delay_s = 0.05
    deltas, final = [], None
    for response in client.stream(build_request("hi", request_id="req-stop", stop=["lo wor"], max_tokens=20)):
        kind = response.WhichOneof("response")
        if kind == "chunk":
            deltas.append(response.chunk.text)
        elif kind == "complete":
            final = response.complete
    assert "".join(deltas) == "Hel" == final.text  # "lo" was held back, never streamed
    assert final.finish_reason == "stop"
    assert list(final.output_token_ids) == ids[:2]  # "Hello", " world"
    assert "req-stop" in fake.aborted
    assert fake.requests[-1].has_stop_strings and fake.num_output_tokens["req-stop"] == 2


def test_stop_string_inside_a_block_counts_only_the_emitted_accepted_tokens(client, stack, tokenizer):
    """Issue 25.2: the coordinator learns where the text was cut, and usage counts up to there."""
    fake, _ = stack
    ids = tokenizer.encode("1: I will never", add_special_tokens=False)
    fake.script = [ids[:1], ids[1:5]]            # the fake: drafted 3, accepted len - 1 = 3
    result = client.generate("hi", request_id="req-cut", stop=[":"], max_tokens=20)
    assert result.text == "1" and result.finish_reason == "stop"
    assert result.usage.completion_tokens == 2
    assert result.usage.num_accepted_tokens == 1 and result.usage.num_drafts == 1
    assert fake.num_output_tokens["req-cut"] == 2
    client.generate("hi", request_id="req-settle", stop=["never-seen"], max_tokens=20)
    assert fake.num_output_tokens["req-settle"] == 5   # finished on its own: settled with all


def test_incremental_detokenization_of_multibyte_characters(client, stack, tokenizer):
    fake, _ = stack
    text = "é漢字🙂 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    fake.script = [[i] for i in ids]
    deltas = list(client.stream_text("hi", max_tokens=20))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert len([d for d in deltas if d]) < len(ids)  # some tokens were partial characters


def test_client_cancel_aborts_at_the_coordinator(client, stack, tokenizer):
    fake, _ = stack
    fake.script = [[tokenizer.encode(" a", add_special_tokens=False)[0]]] * 40
    fake.step_delay_s = 0.1
    stream = client.stream(build_request("hi", request_id="req-cancel", max_tokens=40))
    assert next(stream).WhichOneof("response") == "chunk"
    stream.close()  # cancels the RPC
    deadline = time.monotonic() + 10
    while "req-cancel" not in fake.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "req-cancel" in fake.aborted


def test_an_aborted_request_id_is_free_at_once(client, stack, tokenizer):
    """Abort frees the id when the coordinator confirms, though the aborted stream is still open;
    that stream's later clean-up does not abort the request now holding the id."""
    fake, _ = stack
    fake.script = [[tokenizer.encode(" a", add_special_tokens=False)[0]]] * 40
    fake.step_delay_s = 1.0  # the fake ends the aborted stream only at its next step
    old = client.stream(build_request("hi", request_id="req-reuse", max_tokens=40))
    assert next(old).WhichOneof("response") == "chunk"
    assert client.abort("req-reuse") is True
    again = client.stream(build_request("hi", request_id="req-reuse", max_tokens=40))
    assert next(again).WhichOneof("response") in ("chunk", "complete")  # not INVALID_ARGUMENT "in flight"
    old.close()
    again.close()
    time.sleep(0.5)
    assert fake.aborted.count("req-reuse") == 1  # the Abort only: the first stream's close sends none


def test_abort_rpc_and_list_models(client, stack):
    fake, _ = stack
    assert client.abort("unknown-id") is False
    models = client.list_models()
    assert [m.id for m in models] == [MODEL_NAME] and models[0].max_model_len == MAX_MODEL_LEN


def test_coordinator_error_is_forwarded_in_stream(client, stack):
    fake, _ = stack
    fake.error = common_pb2.GenerateError(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="full")
    try:
        with pytest.raises(GenerationError, match="full"):
            client.generate("hi", max_tokens=4)
    finally:
        fake.error = None


def test_a_coordinator_lost_in_flight_is_named_with_the_tokens_sent(client, stack, tokenizer):
    """Break-it finding: a coordinator killed mid-stream gave the raw "coordinator: Stream removed"."""
    fake, _ = stack
    saved, ok_ids = fake.script, tokenizer.encode("ok", add_special_tokens=False)
    fake.script, fake.break_after_steps = [ok_ids] * 4, 2
    try:
        responses = list(client.stream(build_request("hi", max_tokens=8)))
    finally:
        fake.script, fake.break_after_steps = saved, None
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    error = responses[-1].error
    assert responses[-1].WhichOneof("response") == "error" and error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    num_sent = sum(len(c.token_ids) for c in chunks)
    assert num_sent == 2 * len(ok_ids)
    assert error.message.startswith("coordinator unavailable: the connection broke while the request ran"), error
    assert f"after {num_sent} output tokens" in error.message and "sent again" in error.message, error
    assert [m.id for m in client.list_models()] == [MODEL_NAME]


def test_concurrent_text_and_chat_requests_keep_their_special_token_handling(client, stack, tokenizer):
    fake, _ = stack
    fake.script = [tokenizer.encode("ok", add_special_tokens=False)]

    def send(i: int) -> None:
        if i % 2:
            client.generate(messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=2, request_id=f"cc-{i}")
        else:
            client.generate(f"<|im_start|> text {i}", max_tokens=2, request_id=f"cc-{i}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, range(16)))
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for sent in (r for r in fake.requests if r.request_id.startswith("cc-")):
        is_chat = int(sent.request_id[3:]) % 2 == 1
        assert (im_start in sent.prompt_token_ids) == is_chat, sent.request_id


@pytest.mark.parametrize("method,body", [
    ("Generate", bytes([0x1A, 2, 0xFF, 0xFE])),       # field 3 (prompt): invalid UTF-8
    ("Generate", bytes([0x0A, 5, 0x61])),             # field 1 (request_id): truncated
    ("Abort", bytes([0x0A, 1, 0xC3])),                # request_id: a cut multi-byte character
])
def test_malformed_body_is_invalid_argument_and_the_gateway_keeps_serving(client, stack, method, body):
    _, port = stack
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
            f"/minedraft.v1.MineDraft/{method}", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            response = call(body, timeout=10)
            list(response) if method == "Generate" else response
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    if "UTF-8" in info.value.details():
        assert "prompt" in info.value.details() and "request_id" in info.value.details()
    assert [m.id for m in client.list_models()] == [MODEL_NAME]  # nothing else broke


def test_message_over_the_size_limit_is_refused_and_the_gateway_keeps_serving(client, stack):
    """gRPC's own limit (64 MiB, minedraft.serving) answers RESOURCE_EXHAUSTED before any parsing."""
    _, port = stack
    with MineDraftClient(f"127.0.0.1:{port}", timeout_s=30) as big_client:
        with pytest.raises(grpc.RpcError) as info:
            big_client.generate(prompt="x" * (65 * 1024 * 1024), max_tokens=1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [m.id for m in client.list_models()] == [MODEL_NAME]


@pytest.mark.parametrize("body, where", [
    (bytes([0x1A, 2, 0x68, 0x69, 0x30, 0x05]), "request"),                 # prompt "hi" + sampling (6) as a varint
    (bytes([0x1A, 2, 0x68, 0x69, 0xC8, 0x3E, 0x01]), "request"),           # prompt "hi" + field 1001
    (bytes([0x1A, 2, 0x68, 0x69, 0x32, 0x03, 0xF8, 0x06, 0x01]), "sampling"),  # unknown field inside sampling
    (bytes([0x22, 0x07, 0x0A, 0x05, 0x0A, 0x01, 0x75, 0x58, 0x01]), "messages.messages[0]"),  # inside a message
])
def test_unknown_fields_and_wrong_wire_types_are_refused_naming_where(client, stack, body, where):
    """Issue 25.4: protobuf keeps such fields as unknown and the request would run on defaults."""
    _, port = stack
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/minedraft.v1.MineDraft/Generate", request_serializer=None,
                                    response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            list(call(body, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{where}: unknown field number"), info.value.details()
    assert [m.id for m in client.list_models()] == [MODEL_NAME]


@pytest.mark.parametrize("method, body, details", [
    ("Abort", bytes([0x0A, 1, 0x61, 0xC8, 0x3E, 0x01]), "request: unknown field number"),   # id "a" + field 1001
    ("Abort", bytes([0x08, 0x05]), "request: unknown field number"),                       # request_id as a varint
    ("ListModels", bytes([0xC8, 0x3E, 0x01]), "request: unknown field number"),
    ("Abort", bytes([0x0A, 0x82, 0x08]) + b"a" * 1026, "request_id: must have 1 to 512 characters"),
], ids=["abort-unknown-field", "abort-wrong-wire-type", "list-models-unknown-field", "abort-long-id"])
def test_abort_and_list_models_refuse_unknown_fields_and_long_ids(client, stack, method, body, details):
    """Break-it finding: the wire check of issue 25.4 covered Generate only."""
    _, port = stack
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/minedraft.v1.MineDraft/{method}", request_serializer=None,
                                   response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(body, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(details), info.value.details()
    assert [m.id for m in client.list_models()] == [MODEL_NAME]
