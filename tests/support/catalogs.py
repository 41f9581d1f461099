"""Item catalog files for the built-in model, whose items are semantic-ID paths."""

from __future__ import annotations

import json
import random
from pathlib import Path

SID = 256  # the built-in model: three semantic-ID levels of 256 codes from id 256 (vocab 1024)


def write_catalog(path: Path, seed: int, num: int, codes: int = 256, id_prefix: str = "") -> dict:
    """A catalog file of `num` 3-token items; returns {tuple(path): [item ids]}."""
    rng = random.Random(seed)
    items: dict[tuple, list] = {}
    lines = []
    for i in range(num):
        toks = [SID + d * 256 + rng.randrange(codes) for d in range(3)]
        item_id = f"{id_prefix}{i}" if id_prefix else i
        items.setdefault(tuple(toks), []).append(item_id)
        lines.append(json.dumps({"item_id": item_id, "token_ids": toks, "metadata": {"i": i}}))
    path.write_text("\n".join(lines) + "\n")
    return items


# items of two and three tokens (a sequence may end a step early), none a prefix of another
TWO_LENGTH_ITEMS = [
    (10, 30),
    (10, 31),
    (10, 32, 40),
    (10, 32, 41),
    (11, 30),
    (11, 33, 42),
    (12, 31),
    (12, 34),
    (12, 35, 43),
    (12, 35, 44),
]
