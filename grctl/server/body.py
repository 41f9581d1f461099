"""JSON bodies read strictly: an object that names one key twice is a 400 naming the key.

msgspec (Litestar's decoder) keeps the last of duplicate keys without a word, so
`{"temperature": 0, "temperature": 1e9}` would pass a proxy or log that reads the first one
and run with the second. Every body Litestar decodes as JSON goes through `StrictJSONRequest.
json`, which scans it once with the standard library's parser (objects checked, never built)
before msgspec decodes it; bodies over 64 KiB are scanned off the event loop. What the scan
cannot parse is left to msgspec, which answers it as before.
"""

from __future__ import annotations

import json
from typing import Any

from litestar import Request
from litestar.types import Empty

from grctl.errors import ValidationError
from grctl.server.offload import offload

INLINE_BYTES = 64 << 10


class _Duplicate(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> None:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen.add(key)


def refuse_duplicate_keys(body: bytes) -> None:
    try:
        json.loads(body, object_pairs_hook=_pairs, parse_constant=lambda _: None)
    except _Duplicate as dup:
        key = str(dup.args[0])
        shown = key if len(key) <= 64 else key[:64] + "..."
        raise ValidationError(
            f"the JSON body names the key {shown!r} twice in one object",
            hint="send each field once",
        ) from None
    except (ValueError, RecursionError):
        return  # not JSON the scan can read: msgspec answers it


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if self._json is Empty and self._connection_state.json is Empty:
            body = await self.body()
            if len(body) > INLINE_BYTES:
                await offload(self.app.state, refuse_duplicate_keys, body)
            elif body:
                refuse_duplicate_keys(body)
        return await super().json()
