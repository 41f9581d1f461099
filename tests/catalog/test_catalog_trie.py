"""The array-built trie against a plain dict-of-prefixes built from the same rows."""

from __future__ import annotations

import json
import random

import pytest
import torch

from grctl.catalog.loader import parse_catalog
from grctl.catalog.trie import Trie


def rows_of(seed: int, num: int, depths, max_token: int) -> list[dict]:
    rng = random.Random(seed)
    codes = [rng.randrange(max_token) for _ in range(6)]  # few codes per level: shared prefixes
    rows = []
    for i in range(num):
        path = [rng.choice(codes) if rng.random() < 0.7 else rng.randrange(max_token)]
        path += [rng.choice(codes) for _ in range(rng.choice(depths) - 1)]
        rows.append({"item_id": i, "token_ids": path})
    return rows


@pytest.mark.parametrize(
    ("seed", "depths", "max_token"),
    [(0, (3,), 8192), (1, (1, 2, 3, 4), 50), (2, (2, 5), 2**20), (3, (6,), 2**30)],
)
def test_children_and_items_equal_a_dict(seed, depths, max_token):
    rows = rows_of(seed, 300, depths, max_token)
    data = "\n".join(json.dumps(r) for r in rows).encode()
    parsed = parse_catalog(data, vocab_size=max_token)
    trie = Trie(parsed.paths, parsed.lengths, torch.device("cpu"))
    children: dict[tuple, set] = {}
    items: dict[tuple, list] = {}
    for r in rows:
        path = tuple(r["token_ids"])
        items.setdefault(path, []).append(r["item_id"])
        for d in range(len(path)):
            children.setdefault(path[:d], set()).add(path[d])
    assert trie.stats.num_paths == len(items) and trie.stats.num_items == len(rows)
    assert trie.stats.num_nodes == 1 + len({p[: d + 1] for p in items for d in range(len(p))})
    for prefix, kids in children.items():
        node = trie.walk(list(prefix))
        assert node is not None
        tokens, nodes, valid = trie.children(torch.tensor([node]), trie.width(len(prefix)))
        got = tokens[0][valid[0]].tolist()
        assert got == sorted(kids)  # ascending, each once
        for tok, child in zip(got, nodes[0][valid[0]].tolist(), strict=True):
            assert trie.walk([*prefix, tok]) == child
    for path, ids in items.items():
        node = trie.walk(list(path))
        assert bool(trie.is_terminal[node])
        assert [parsed.ids.get(int(i)) for i in trie.items_of(node)] == ids  # file order
    leaving = next(t for t in range(max_token) if t not in children[()])
    assert trie.walk([leaving]) is None
    shadowed = sum(
        1
        for p in (tuple(r["token_ids"]) for r in rows)
        if any(p[:d] in items for d in range(1, len(p)))
    )
    assert trie.stats.num_shadowed_items == shadowed
