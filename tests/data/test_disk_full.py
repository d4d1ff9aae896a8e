"""A disk that fills up during data preparation: a clear error, no half-written cache entry, then a fresh start.

The full disk is real: a small tmpfs mounted in a private mount namespace
(``unshare``; as an unprivileged user, inside a user namespace too), so every write
fails as it would on a full disk, with ENOSPC from the kernel, whichever library
makes it: Python's json, pyarrow, matplotlib, and the tokenizers library (Rust),
which raises a bare ``Exception``. tests/data/full_disk.py runs in there and fills the
disk so that preparation fails (1) half-way through the tokenizer's ``tokenizer.json``,
(2) half-way through the entry, (3) at its last page; then frees the space.
"""

import errno
import json
import subprocess
import sys

import pytest

from tests.mount_namespace import NO_NAMESPACE, namespace_prefix, tmpfs_mount
from tests.small import REPO

pytestmark = pytest.mark.integration

MOUNT = tmpfs_mount("16m")


def test_a_full_disk_leaves_no_cache_entry_and_a_later_run_prepares_afresh(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    prefix = namespace_prefix(disk)
    if prefix is None:
        pytest.skip(NO_NAMESPACE + "no real full disk to test on")
    done = subprocess.run(
        [*prefix, "sh", "-c", f'{MOUNT} && exec "$2" -m tests.data.full_disk "$1"', "sh", str(disk), sys.executable],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    entry = out["entry"]
    for what, failure in out["failures"].items():
        assert failure is not None, f"{what}: the preparation did not fail"
        assert (failure["type"], failure["errno"], failure["filename"]) == ("OSError", errno.ENOSPC, entry), failure
        assert failure["left"] == [], f"{what}: left in the cache folder: {failure['left']}"  # no entry, partial, lock
        message = failure["message"]
        assert message.startswith(f"The disk is full while writing {entry}: the filesystem mounted at {disk} "), message
        assert "no half-written data is ever reused" in message and "\n" not in message
    # the tokenizers library's own error (Rust, no errno) is recognised as a full disk too
    assert "os error 28" in out["failures"]["tokenizer.json half written"]["cause"]
    # with space: prepared afresh (not a hit on anything left behind), the same bytes as on an empty disk, then reused
    assert out["after"] == {"cached": False, "same_bytes": True, "hit_next": True}
