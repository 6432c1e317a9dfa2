"""The README's Python blocks run as written: in order, in one namespace, in a fresh process
started in the repository root (where a reader of a fresh clone runs them), so that an edit
that breaks one fails the suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    """The ```python blocks of README.md, in order."""
    return re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M)


def test_the_files_the_python_blocks_read_are_in_the_repository():
    """A cost model read from a file (``table:PATH``, ``profile:PATH``) names a file of the
    clone, not one the reader has yet to make; and no block reads a file from outside it."""
    code = "\n".join(python_blocks())
    assert python_blocks()
    for path in re.findall(r"""["'](?:table|profile):([^"'+]+)""", code):
        assert not Path(path).is_absolute() and (REPO / path).resolve().is_relative_to(REPO), path
        assert (REPO / path).exists(), path


@pytest.mark.slow
def test_the_python_blocks_run_in_order(tmp_path):
    script = tmp_path / "readme.py"
    script.write_text("\n\n".join(python_blocks()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "fsdp-sched backward" in done.stdout  # the report's summary line the first block prints
