"""Exit 0 when the active Python already has hybrid installed from this checkout with all its requirements.

    python launch_scripts/env_complete.py REPO_DIR [EXTRAS]

Used by ``setup_env.sh`` to skip ``pip install`` (seconds, and network access)
when there is nothing to install. Reads only package metadata: nothing heavy
is imported. The requirements are pyproject.toml's (the installed metadata's
when ``tomllib`` is missing, before Python 3.11), plus those of the
comma-separated EXTRAS. Any doubt answers "not complete" (exit 1), which only
costs a ``pip install``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import sys


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement  # pip always carries it
    return Requirement


def _declared(repo: str, extras: set) -> list:
    """Requirement strings: the project's dependencies and those of the requested extras."""
    try:
        import tomllib
    except ImportError:
        return list(metadata.distribution("hybrid").requires or [])
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return reqs


def _installed_from(repo: str) -> bool:
    spec = importlib.util.find_spec("hybrid")
    origin = spec.origin if spec is not None else None
    return origin is not None and os.path.realpath(origin).startswith(os.path.realpath(repo) + os.sep)


def complete(repo: str, extras: set) -> bool:
    if not _installed_from(repo):
        return False
    requirement = _requirement_class()
    for text in _declared(repo, extras):
        req = requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            return False
        if not req.specifier.contains(version.split("+")[0], prereleases=True):
            return False
    return True


def main(argv) -> int:
    repo = argv[1]
    extras = {e.strip() for e in (argv[2] if len(argv) > 2 else "").split(",") if e.strip()}
    try:
        return 0 if complete(repo, extras) else 1
    except Exception:  # noqa: BLE001 - unreadable metadata: let pip decide
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
