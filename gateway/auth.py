"""Optional API key for the public gRPC service (torch-free).

With ``GatewayConfig.api_key`` set (``--api-key`` / ``$MINEDRAFT_API_KEY``), every call of
``minedraft.v1.MineDraft`` must carry the gRPC metadata ``authorization: Bearer <api_key>``
(the same header the HTTP API takes); otherwise it ends with UNAUTHENTICATED before any work is
done. Health and reflection stay open, so probes and ``grpcurl list`` work without the key.
The comparison is constant-time (``hmac.compare_digest``).
"""
from __future__ import annotations

import hmac

import grpc

AUTH_METADATA_KEY = "authorization"
PROTECTED_PREFIX = "/minedraft.v1.MineDraft/"


def bearer_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends for ``api_key`` (empty when there is no key)."""
    return ((AUTH_METADATA_KEY, f"Bearer {api_key}"),) if api_key else ()


def _deny(message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(abort)


def _deny_stream(message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator (server streaming)

    return grpc.unary_stream_rpc_method_handler(abort)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio server interceptor enforcing ``authorization: Bearer <api_key>`` on the MineDraft API.

    Raises:
        ValueError: ``api_key`` is empty (no interceptor is needed then).
    """

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key: must not be empty")
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(PROTECTED_PREFIX):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(given.encode(), self._expected):
            return await continuation(handler_call_details)
        message = "missing or invalid API key: send metadata 'authorization: Bearer <key>'"
        return _deny_stream(message) if method.endswith("/Generate") else _deny(message)
