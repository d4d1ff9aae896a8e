"""Running a command where it may mount a filesystem of its own: a private mount namespace (``unshare``).

As an unprivileged user the namespace is also a user namespace (``--map-root-user``),
so mounting needs no root on the machine. The tests that need it (a real full disk, a
worker that does not see the run folder) skip with this reason where it is not allowed.
"""

import shutil
import subprocess
from pathlib import Path

NO_NAMESPACE = "cannot mount a tmpfs in a private mount namespace here (unshare): "


def tmpfs_mount(size: str) -> str:
    """A shell command mounting a tmpfs of ``size`` (``16m``) on ``"$1"``."""
    return f'mount -t tmpfs -o size={size} bhfl-full-disk "$1"'


def namespace_prefix(probe: Path) -> list[str] | None:
    """A command prefix that runs its command where it may mount a tmpfs of its own (tried on ``probe``), or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ([unshare, "--user", "--map-root-user", "--mount"], [unshare, "--mount"]):
        done = subprocess.run(
            [*prefix, "sh", "-c", tmpfs_mount("1m"), "sh", str(probe)], capture_output=True, check=False
        )
        if done.returncode == 0:
            return prefix
    return None
