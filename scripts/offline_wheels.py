"""Wheels of bhfl's dependencies for a machine that cannot reach a package index (a GPU box, say).

A GPU machine behind a firewall usually has its own CUDA build of torch and a stack
around it, but not Prefect, MLflow or Dask. This script, run here with the project's
``.venv`` (which holds the tested versions), downloads binary wheels of what bhfl needs
at run time for the *target's* Python and platform, leaving out what the target already
has, into one folder to copy over; there:

    python3 -m pip install --no-index --no-deps DEST/*.whl
    python3 -m pip install --no-index --no-deps --no-build-isolation --ignore-requires-python -e .

What is downloaded, exactly: the distributions that ``bhfl``'s requirements reach in this
``.venv`` (transitively, extras as requested; the ``dev`` extra's linters and test tools
not), each at the version installed here, minus:

* torch and NVIDIA's CUDA packages (``nvidia-*``, ``triton``): the target's own build is
  the one that matches its driver, and a CPU wheel from here would replace it;
* every distribution named in ``--have FILE`` (the target's ``python3 -m pip list
  --format=freeze``, or one name per line): their versions there are used as they are.

``--modules M ...`` instead takes only the distributions that importing those modules here
loads (e.g. ``bhfl_core.learning.models`` for a check that trains a model and nothing
else), for a folder that must stay small. ``--add REQ ...`` adds requirements of its own
(``bitsandbytes==0.50.2`` for the ``gpu`` extra), downloaded whether installed here or not.

Usage:  .venv/bin/python scripts/offline_wheels.py DEST [--python-version 3.12]
        [--have FILE] [--modules M ...] [--add REQ ...]
Prints each wheel and the folder's size.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

PROJECT = "bhfl"
TARGET_BUILDS = re.compile(r"^(torch|triton|nvidia-.*)$")  # the target's CUDA stack: never replaced from here
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, md.Distribution]:
    return {canonical(d.metadata["Name"]): d for d in md.distributions() if d.metadata["Name"]}


def runtime_closure(dists: dict[str, md.Distribution], extras: set[str]) -> set[str]:
    """Every installed distribution that bhfl's requirements (with ``extras``) reach, bhfl included."""
    found: set[str] = set()
    todo: list[tuple[str, set[str]]] = [(PROJECT, extras)]
    while todo:
        name, wanted = todo.pop()
        name = canonical(name)
        if name in found or name not in dists:
            continue
        found.add(name)
        for line in dists[name].requires or []:
            req = Requirement(line)
            markers = [{"extra": e} for e in (wanted or {""})]
            if req.marker is None or any(req.marker.evaluate(m) for m in markers):
                todo.append((req.name, set(req.extras)))
    return found


def imported_by(modules: list[str]) -> set[str]:
    """The installed distributions whose top-level packages importing ``modules`` loads."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    for module in modules:
        importlib.import_module(module)
    owners = md.packages_distributions()
    return {canonical(d) for m in list(sys.modules) for d in owners.get(m.split(".")[0], [])}


def target_has(path: Path | None) -> set[str]:
    """Names in a ``pip list --format=freeze`` (or one-name-per-line) file."""
    if path is None:
        return set()
    names = (re.split(r"[=<>~! @;]", line.strip(), maxsplit=1)[0] for line in path.read_text().splitlines())
    return {canonical(n) for n in names if n and not n.startswith("#")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the folder to fill (created)")
    parser.add_argument("--python-version", default="3.12", help="the target's Python, e.g. 3.12")
    parser.add_argument("--have", type=Path, help="the target's `pip list --format=freeze`: left out")
    parser.add_argument("--modules", nargs="+", help="only what importing these modules loads")
    parser.add_argument("--extras", nargs="*", default=[], help="bhfl extras to include (not `dev`)")
    parser.add_argument("--add", nargs="+", default=[], help="further requirements, e.g. bitsandbytes==0.50.2")
    args = parser.parse_args()

    dists = installed()
    wanted = imported_by(args.modules) if args.modules else runtime_closure(dists, set(args.extras))
    skip = target_has(args.have) | {canonical(PROJECT)}
    pins = sorted(
        f"{dists[n].metadata['Name']}=={dists[n].version}"
        for n in wanted
        if n in dists and n not in skip and not TARGET_BUILDS.match(n)
    )
    pins += args.add
    if not pins:
        sys.exit("nothing to download: the target has everything")
    args.dest.mkdir(parents=True, exist_ok=True)
    platforms = [flag for p in [*PLATFORMS, "any"] for flag in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", args.python_version, "--implementation", "cp", *platforms, "-d", str(args.dest)]
    done = subprocess.run([*cmd, *pins], check=False, capture_output=True, text=True)
    noise = "is ignored: it is neither"  # some pip configurations' note on every missing local index
    errors = "\n".join(line for line in done.stderr.splitlines() if noise not in line)
    if done.returncode:
        sys.exit(f"pip download failed:\n{errors}")
    wheels = sorted(args.dest.glob("*.whl"))
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.1f} MB  {wheel.name}")
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {total:.1f} MB in {args.dest} ({len(pins)} requirements)")


if __name__ == "__main__":
    main()
