"""The package as a user imports it: ``import scheduler`` and the README's API lines."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_submodules_resolve_after_a_bare_import():
    """``import scheduler; scheduler.compile.backend(...)`` (the README's example) works in a
    fresh interpreter that imported nothing else; an unknown name is still an AttributeError."""
    out = _run("import scheduler\n"
               "assert callable(scheduler.compile.backend)\n"
               "assert callable(scheduler.cache.cache_key)\n"
               "try:\n    scheduler.no_such_thing\nexcept AttributeError:\n    print('ok')\n")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
