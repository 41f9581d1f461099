"""The catalog routes' body and reply, and the item rows of a generate reply (docs/catalog.md)."""

import msgspec
from msgspec import Struct


class CatalogReloadBody(Struct, kw_only=True):
    path: str | None = None  # a JSONL file on the server (under --weights-root when set)


class CatalogRollbackBody(Struct, kw_only=True, forbid_unknown_fields=True):
    # roll back even to a catalog installed with other weights than the served ones (else 409)
    force: bool = False


class CatalogStatus(Struct, kw_only=True):
    loaded: bool = False
    version: int | None = None  # grows by one per reload; rollback returns to the previous one
    num_items: int = 0
    num_paths: int = 0  # distinct token paths (several items may share one)
    max_depth: int = 0
    nbytes: int = 0  # the trie and item ids, as held
    source: str | None = None
    loaded_at: float | None = None  # unix time
    num_nodes: int = 0
    num_collision_paths: int = 0
    num_shadowed_items: int = 0  # items whose path extends another item's: never returned
    # no token that begins an item path recurs further along one: a prompt ending in part of
    # an item resumes inside it (docs/catalog.md "Partial items")
    self_delimiting: bool = False
    previous_version: int | None = None  # what /catalog/rollback would serve
    num_reloads: int = 0
    num_rollbacks: int = 0
    # the weights' version when it was installed (a sync with catalog_path installs both)
    weight_version: str | None = None


class ItemResultOut(Struct, kw_only=True):
    """One beam read against the server's item catalog (grctl only)."""

    rank: int = 0
    token_ids: list[int] = msgspec.field(default_factory=list)
    item_ids: list[int | str] = msgspec.field(default_factory=list)  # several: a collision
    item_id: int | str | None = None  # the first of item_ids
    is_complete: bool = False  # the beam's tokens spell a whole item path
    score: float = 0.0
