"""The package as a user imports it: ``import scheduler`` and the README's API lines."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_submodules_resolve_after_a_bare_import():
    """``import scheduler; scheduler.backend(...)`` (the README's example) works in a fresh
    interpreter that imported nothing else, and so does a subpackage of a pipeline step; an
    unknown name is still an AttributeError."""
    out = _run("import scheduler\n"
               "assert callable(scheduler.backend) and callable(scheduler.inductor_post_grad_pass)\n"
               "assert callable(scheduler.SolverOptions) and callable(scheduler.optimize_schedule)\n"
               "import scheduler.integrate.cache\n"
               "assert callable(scheduler.integrate.cache.cache_key)\n"
               "try:\n    scheduler.no_such_thing\nexcept AttributeError:\n    print('ok')\n")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
