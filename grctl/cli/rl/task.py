"""The RL loop's synthetic task: a generated catalog over the built-in model's semantic IDs,
users who each prefer a hidden set of items, and the reward of the item recommended to one.

An item is three tokens, one per semantic-ID level. The catalog draws each level's code from
the first `codes` of the level's 256, so a policy that knows nothing still lands on a
preferred item's first code now and then: the reward is the longest semantic-ID prefix the
item shares with any of the user's preferred items, over three (1.0 for a preferred item).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from grctl.model.builtin import NUM_TEXT_TOKENS, SID_CODES, SID_LEVELS

BOS = 1
FIRST_USER_TOKEN = 16  # users are text tokens 16, 17, ...


@dataclass(frozen=True)
class Task:
    items: dict[tuple[int, ...], str]  # token path -> item id
    preferred: tuple[frozenset[tuple[int, ...]], ...]  # per user, hidden from the policy
    children: dict[tuple[int, ...], tuple[int, ...]]  # a path prefix -> the tokens after it

    @property
    def num_users(self) -> int:
        return len(self.preferred)

    def prompt(self, user: int) -> list[int]:
        return [BOS, FIRST_USER_TOKEN + user]

    def reward(self, user: int, path: list[int] | tuple[int, ...]) -> float:
        """The longest prefix `path` shares with one of `user`'s preferred items, over three."""
        best = 0
        for item in self.preferred[user]:
            shared = 0
            while shared < min(len(item), len(path)) and item[shared] == path[shared]:
                shared += 1
            best = max(best, shared)
        return best / SID_LEVELS

    def catalog_bytes(self) -> bytes:
        """The catalog as `grctl serve --catalog` reads it (JSON lines)."""
        lines = (json.dumps({"item_id": i, "token_ids": list(p)}) for p, i in self.items.items())
        return ("\n".join(lines) + "\n").encode()

    def write_catalog(self, path: Path) -> Path:
        path.write_bytes(self.catalog_bytes())
        return path


def make_task(
    num_users: int = 8,
    num_items: int = 512,
    num_preferred: int = 16,
    codes: int = 16,
    seed: int = 0,
) -> Task:
    """A catalog of `num_items` distinct items and `num_preferred` hidden favourites per user,
    all drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    offsets = NUM_TEXT_TOKENS + SID_CODES * torch.arange(SID_LEVELS)
    paths: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    while len(paths) < num_items:
        row = tuple((torch.randint(0, codes, (SID_LEVELS,), generator=gen) + offsets).tolist())
        if row not in seen:
            seen.add(row)
            paths.append(row)
    children: dict[tuple[int, ...], set[int]] = {}
    for p in paths:
        for depth in range(SID_LEVELS):
            children.setdefault(p[:depth], set()).add(p[depth])
    preferred = []
    for _ in range(num_users):
        pick = torch.randperm(len(paths), generator=gen)[:num_preferred].tolist()
        preferred.append(frozenset(paths[i] for i in pick))
    return Task(
        items={p: f"item-{i}" for i, p in enumerate(paths)},
        preferred=tuple(preferred),
        children={k: tuple(sorted(v)) for k, v in children.items()},
    )
