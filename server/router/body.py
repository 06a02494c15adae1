"""A request's JSON body, parsed once with bounded cost (the bytes are bounded by ``limits.BodyLimit``)."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request

from distserve.server.router import protocol
from distserve.server.router.protocol import InvalidRequest

PARSE_INLINE_BYTES = 256 << 10  # larger bodies are parsed off the event loop


async def json_body(request: Request):
    raw = await request.body()  # at most router.max_request_body_bytes (BodyLimit)
    try:
        body = json.loads(raw) if len(raw) < PARSE_INLINE_BYTES else await asyncio.to_thread(json.loads, raw)
    except RecursionError:
        raise InvalidRequest("request body nests JSON too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or an integer of > 4300 digits
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    protocol.check_unicode(body)
    request.state.json_body = body  # the request as sent, should admission send it to the backup pool
    return body
