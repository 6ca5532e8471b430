"""Registers the public ``minedraft.v1.MineDraft`` service with request parsing that cannot fail.

gRPC's generated registration parses a request with ``FromString``; a malformed message (e.g. a
string field that is not valid UTF-8) then fails inside grpcio and reaches the client as
``UNKNOWN``. Here the parser returns a ``MalformedRequest`` instead, and the servicer answers it
with ``INVALID_ARGUMENT`` (issue 5, point 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from minedraft.v1 import common_pb2, generate_pb2

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["MineDraft"].full_name
STRING_FIELDS = "request_id, model, prompt, messages or stop"


@dataclass(frozen=True)
class MalformedRequest:
    """A request body that did not parse; ``reason`` is protobuf's message."""

    reason: str

    def message(self) -> str:
        """The INVALID_ARGUMENT detail, naming the fields that can hold bad text."""
        if "UTF-8" in self.reason:
            return f"{STRING_FIELDS}: a string field is not valid UTF-8 ({self.reason})"
        return f"request: not a valid {SERVICE_NAME} message ({self.reason})"


def tolerant_parser(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """``parse`` that returns ``MalformedRequest`` instead of raising ``DecodeError``."""
    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError as exc:
            return MalformedRequest(str(exc))
    return deserialize


def add_gateway_servicer(servicer, server: grpc.aio.Server) -> None:
    """Like ``generate_pb2_grpc.add_MineDraftServicer_to_server`` with ``tolerant_parser``."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=tolerant_parser(generate_pb2.GenerateRequest.FromString),
            response_serializer=generate_pb2.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=tolerant_parser(common_pb2.AbortRequest.FromString),
            response_serializer=common_pb2.AbortResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=tolerant_parser(generate_pb2.ListModelsRequest.FromString),
            response_serializer=generate_pb2.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
