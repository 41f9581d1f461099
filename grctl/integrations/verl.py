"""verl's plugin for `actor_rollout_ref.rollout.name=grctl`, loaded by `import verl` in every
process: it adds "grctl" to verl's two rollout registries, lazily.

verl (0.9.1) resolves its rollout by name twice: in the driver through RolloutReplicaRegistry
(verl.workers.rollout.replica: the replica, and the server actor its agent loops generate
through) and in each trainer worker through `_ROLLOUT_REGISTRY` (verl.workers.rollout.base:
the adapter that syncs weights into the rollout). verl imports this module at `import verl`,
through the `verl.plugins` entry point grctl declares, or VERL_USE_EXTERNAL_MODULES=
grctl.integrations.verl. Importing those two registries (~390 modules) and grctl's client
(~130) then would cost every verl process, grctl's rollout or not; so this module imports
nothing of either: it registers grctl in each registry the moment verl's own module holding
it is imported (at once if it already is), and the replica class (verl_rollout.py) only when
verl asks the registry for "grctl". A registration that fails is logged at warning (verl
logs a plugin's failure at debug level only, so it would go unseen).

GRCTL_VERL_ROLLOUT_NAMES=two_stage (in every process's environment) serves a recipe's own
rollout name from grctl too, and keeps it grctl's when the recipe registers its backend under
that name later: verl-GR's OpenOneRec recipe unchanged, with rollout.name=two_stage.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType

log = logging.getLogger("grctl.integrations.verl")
NAME = "grctl"
ROLLOUT = "grctl.integrations.verl_rollout"
ADAPTER = "grctl.integrations.verl_weights.GrctlServerAdapter"
PINNED_ENV = "GRCTL_VERL_ROLLOUT_NAMES"
REPLICA, BASE = "verl.workers.rollout.replica", "verl.workers.rollout.base"


class _Pinned(dict):
    """A registry in which some names stay grctl's: a later registration of them is ignored."""

    def __init__(self, entries: dict, pinned: frozenset):
        super().__init__(entries)
        self.pinned = pinned

    def __setitem__(self, key, value) -> None:
        name = key[0] if isinstance(key, tuple) else key
        if name in self.pinned and key in self:
            return
        super().__setitem__(key, value)


def pinned_names() -> frozenset:
    """GRCTL_VERL_ROLLOUT_NAMES (comma-separated): rollout names served by grctl besides
    "grctl", kept so when a recipe registers its own backend under them later (verl-GR's
    OpenOneRec recipe registers its vLLM replica as "two_stage" in its prepare step)."""
    raw = os.environ.get(PINNED_ENV, "")
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def replica_class() -> type:
    """GrctlReplica: the registry's loader for "grctl", run when verl builds the replica."""
    rollout = importlib.import_module(ROLLOUT)
    if rollout.MISSING is not None:
        raise ImportError(f"grctl's verl rollout needs verl and ray: {rollout.MISSING}")
    return rollout.GrctlReplica


def register_replica(replica: ModuleType) -> None:
    extra = pinned_names()
    registry = replica.RolloutReplicaRegistry
    for name in (NAME, *sorted(extra)):
        registry.register(name, replica_class)
    if extra:  # verl reads the dict by name at call time: a pinned copy replaces it
        registry._registry = _Pinned(registry._registry, extra)


def register_adapter(base: ModuleType) -> None:
    extra = pinned_names()
    for name in (NAME, *sorted(extra)):
        base._ROLLOUT_REGISTRY[(name, "async")] = ADAPTER
    if extra:
        base._ROLLOUT_REGISTRY = _Pinned(base._ROLLOUT_REGISTRY, extra)


_pending: dict[str, Callable[[ModuleType], None]] = {}


def _run(hook: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        hook(module)
    except Exception as exc:  # noqa: BLE001  (verl's own import must go on)
        log.warning(
            "grctl's verl plugin could not register rollout %r in %s (rollout.name=grctl will "
            "be unknown to verl): %s: %s",
            NAME,
            module.__name__,
            type(exc).__name__,
            exc,
        )


class _Then(importlib.abc.Loader):
    """A module's own loader, then its registration."""

    def __init__(self, loader, name: str):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        hook = _pending.pop(self.name, None)
        if not _pending:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        if hook is not None:
            _run(hook, module)

    def __getattr__(self, attr: str):
        return getattr(self.loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a pending verl module found by the others."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Then(spec.loader, fullname)
        return spec


def install() -> None:
    """Register grctl in each of verl's two registries once its module is imported."""
    for name, hook in ((REPLICA, register_replica), (BASE, register_adapter)):
        module = sys.modules.get(name)
        if module is not None:
            _run(hook, module)
        else:
            _pending[name] = hook
    if _pending and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def __getattr__(name: str):
    """The rollout's names (GrctlServer, server_url, ...), as this module held them before."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(ROLLOUT), name)


try:
    install()
except Exception as exc:  # noqa: BLE001
    log.warning("grctl's verl plugin failed to load: %s: %s", type(exc).__name__, exc)
    raise
