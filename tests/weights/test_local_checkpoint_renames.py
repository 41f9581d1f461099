"""A local checkpoint pull (miles' `local_checkpoint_dir`, weights/local_checkpoint.py) cut
short at each rename it makes, as a kill would cut it: the directory is wholly the old
version or wholly the new one (its tensors against the checkpoints' own), and the same pull
then works. The base has four shards, two of which the step changes.
(tests/e2e/test_local_checkpoint_crash.py SIGKILLs a real server at named steps.)"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from grctl.weights import local_checkpoint
from tests.e2e.test_delta_sync import step
from tests.e2e.test_miles_delta import publish_like_miles
from tests.support.checkpoints import dir_tensors, write_checkpoint


class Killed(BaseException):
    """Raised in place of the n-th rename: nothing after it runs, as after a SIGKILL."""


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("local-renames")
    base = write_checkpoint(root / "base", seed=7, max_shard_size="100KB")
    old = dir_tensors(base)
    new = step(old, seed=70)
    publish_like_miles(root / "pub", 1, old, new, "overwrite")
    return root, base, old, new


def wholly(local, old: dict, new: dict) -> int:
    marker = local_checkpoint.local_version(local)
    tensors = dir_tensors(local)
    is_old = all(torch.equal(tensors[k], old[k]) for k in old)
    is_new = all(torch.equal(tensors[k], new[k]) for k in new)
    assert (marker, is_old, is_new) in ((0, True, False), (1, False, True)), (marker, is_old)
    return marker


def pull_cut_after(renames: int, *args) -> bool:
    """The pull, its rename past the first `renames` raising Killed: whether it finished."""
    real = {name: getattr(os, name) for name in ("replace", "rename")}
    calls = 0

    def counted(name: str, *a, **kw):
        nonlocal calls
        calls += 1
        if calls > renames:
            raise Killed(name)
        return real[name](*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        for name in real:
            mp.setattr(os, name, functools.partial(counted, name))
        try:
            local_checkpoint.pull(*args)
        except Killed:
            return False
    return True


def test_a_pull_cut_at_each_rename_leaves_one_version(published):
    root, base, old, new = published
    for cut in range(20):
        local = root / f"local-{cut}"
        local_checkpoint.pull(local, root / "pub", 0, base)
        done = pull_cut_after(cut, local, root / "pub", 1, base)
        wholly(local, old, new)
        assert local_checkpoint.pull(local, root / "pub", 1, base)[0] in (0, 1)
        assert wholly(local, old, new) == 1
        if done:  # every rename of a pull has been cut once
            break
    else:
        pytest.fail("the pull never finished within 20 renames")
