"""The trainers' own code at test time: slime's and miles' Python, read from a snapshot of their
repositories and imported unchanged, never copied into this project.

GRCTL_PEERS_DIR (default /work/.mirror) holds one snapshot per repository, as `owner+name/repo`
(a bare git directory, read at HEAD), `owner+name` (a bare git directory or a checkout) or
`name` (a checkout). `peer_package` extracts a package's files into a test's tmp_path and puts
it first on sys.path; a test whose snapshot is missing is skipped, saying which and where.
Third-party modules the package imports at module level and that are not installed here get a
stub (`stub_modules`) whose every name is a placeholder that raises when it is called, so a
stub the flow under test really used fails the test instead of answering for it.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

PEERS_DIR = Path(os.environ.get("GRCTL_PEERS_DIR", "/work/.mirror"))


def _snapshot(repo: str) -> tuple[str, Path] | None:
    """("git", bare dir) or ("tree", checkout) for owner/name, or None."""
    owner, name = repo.split("/")
    for cand in (PEERS_DIR / f"{owner}+{name}" / "repo", PEERS_DIR / f"{owner}+{name}"):
        if (cand / "HEAD").is_file() and (cand / "objects").is_dir():
            return "git", cand
    for cand in (PEERS_DIR / f"{owner}+{name}", PEERS_DIR / name):
        if (cand / ".git").exists() or (cand / name.replace("-", "_")).is_dir():
            return "tree", cand
    return None


def extract(repo: str, folder: str, dest: Path) -> str:
    """Copy `folder` (or one file) of the snapshot of `repo` into dest; returns the snapshot's
    commit (or path). Skips the test when there is no snapshot."""
    found = _snapshot(repo)
    if found is None:
        pytest.skip(f"no snapshot of {repo} under GRCTL_PEERS_DIR={PEERS_DIR}")
    kind, where = found
    if kind == "tree":
        import shutil

        if (where / folder).is_file():  # one file of the snapshot
            (dest / folder).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(where / folder, dest / folder)
        else:
            shutil.copytree(where / folder, dest / folder)
        return str(where)
    git = ["git", f"--git-dir={where}"]
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    blob = subprocess.run(git + ["archive", "HEAD", folder], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(blob.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return commit.stdout.strip()


class _Missing:
    """A name of a module that is not installed: calling it says so."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a test stub: the module is not installed")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")


def _stub(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so its submodules can be stubbed too

    def getattr_(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{name}.{attr}")

    module.__getattr__ = getattr_
    return module


@contextmanager
def peer_package(
    repo: str, package: str, dest: Path, stub_modules: tuple[str, ...] = ()
) -> Iterator[str]:
    """Extract `package` of `repo` into dest and make it importable (with stubs for the listed
    modules that are not installed); undone on exit. Yields the snapshot's commit."""
    commit = extract(repo, package, dest)
    stubbed = [m for m in stub_modules if not _installed(m)]
    for name in stubbed:
        sys.modules[name] = _stub(name)
    sys.path.insert(0, str(dest))
    try:
        yield commit
    finally:
        sys.path.remove(str(dest))
        for name in list(sys.modules):
            if name == package or name.startswith(package + ".") or name in stubbed:
                del sys.modules[name]
        importlib.invalidate_caches()


def _installed(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
