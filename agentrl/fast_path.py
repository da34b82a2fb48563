"""A pure-ASGI fast path in front of a FastAPI route, for the requests that route serves most.

At thousands of calls/s, Starlette's routing, FastAPI's request parsing and its dependency solving cost about as
much CPU as the work a call does (the tool server's calls, the agent gateway's turns). A fast path takes a request
before them: it reads the body (within the size limit), validates it in one pass (`model_validate_json`), and
answers. Anything it does not take (invalid JSON, a validation error, a missing key) it hands on, body included,
to the FastAPI route, which answers as it always does. So the route stays the one definition of the API, its
OpenAPI document and every error answer; the fast path only skips the framework for requests that will succeed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

FastHandler = Callable[[bytes, dict[bytes, bytes]], Awaitable[Response | None]]  # body, headers -> answer or None
JSON_TYPE = b"application/json"


def takes_json(headers: dict[bytes, bytes]) -> bool:
    """A JSON body, as FastAPI reads one (other types, +json ones included, go to the route)."""
    content_type = headers.get(b"content-type", b"")
    return content_type == JSON_TYPE or content_type.partition(b";")[0].strip().lower() == JSON_TYPE


async def serve_fast(
    fast: FastHandler,
    app: Any,
    scope: dict,
    receive: Any,
    send: Any,
    max_body: int,
    too_large: Callable[[Any], Awaitable[None]],
) -> None:
    """Read the body (over `max_body` bytes: `too_large(send)` answers), then answer from `fast`, or hand the
    request, its body replayed, to `app`."""
    headers = dict(scope.get("headers") or ())
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect: nobody is waiting for an answer
            return
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body:
            await too_large(send)
            return
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    response = await fast(body, headers)
    if response is not None:
        await response(scope, receive, send)
        return
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    await app(scope, replay, send)
