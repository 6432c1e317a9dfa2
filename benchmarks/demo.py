"""The demo from a clone: ``python benchmarks/demo.py [options]`` is ``fsdp-sched demo [options]``.

fsdp-sched against FSDP2-like, torch's scheduler and SimpleFSDP-like, each at its own peak
memory, on the written graphs (:mod:`scheduler.cli.demo` says what it runs and prints):

    python benchmarks/demo.py                                      # llama3-8b, 8 layers, 64 ranks
    python benchmarks/demo.py --model llama3-debug --n-layers 2 --world-size 8    # in seconds
    python benchmarks/demo.py -v                                   # with the progress log
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scheduler.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
