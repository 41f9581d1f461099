"""A route's parameters from its query and its JSON body: SGLang's clients send GET with a JSON
body to some routes (/get_weights_by_name, the memory routes), others send the query. Also the
one reading of a `timeout` in seconds."""

from __future__ import annotations

import json
import math

from litestar import Request

from grctl.errors import ValidationError


async def merged_params(request: Request) -> dict:
    """Query parameters overlaid by a JSON body."""
    params: dict = dict(request.query_params)
    raw = await request.body()
    if raw.strip():
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ValidationError(f"body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ValidationError("body must be a JSON object")
        params.update(body)
    return params


def seconds(timeout: float | None, limit: float, default: float) -> float:
    """A client's `timeout` as a wait: `default` when omitted, at most `limit` (so 1e10 or
    inf wait as long as the server would); nan or a negative number is a 400."""
    if timeout is None:
        return default
    if math.isnan(timeout) or timeout < 0:
        raise ValidationError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    return min(timeout, limit)
