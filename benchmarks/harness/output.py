"""How a benchmark ends: its tables printed, its wall time, its rows saved as JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def finish(text: str, rows: list[dict[str, Any]], t0: float, json_path: Path | None) -> int:
    """Print ``text`` (the benchmark's tables) and the seconds since ``t0``; write ``rows`` to
    ``json_path`` when given. Returns the exit status (0)."""
    print(text)
    print(f"({time.perf_counter() - t0:.0f} s in all)")
    if json_path:
        json_path.write_text(json.dumps(rows, indent=1))
    return 0
