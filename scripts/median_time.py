#!/usr/bin/env python3
"""Time a command: run it N times (output discarded) and print the median wall time and the range.

    python scripts/median_time.py [-n 10] -- python -m hfsdp.flags

For the README's figures of how long a command takes (a benchmark, not a test); a run that fails
stops the timing with its exit status. Standard library only.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="median_time", description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=10, help="runs (default 10)")
    ns = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command or ns.n < 1:
        parser.error("give -n >= 1, then -- and the command to time")
    times = []
    for _ in range(ns.n):
        start = time.perf_counter()
        rc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        times.append(time.perf_counter() - start)
        if rc != 0:
            print(f"median_time: {' '.join(command)} exited {rc}; nothing timed", file=sys.stderr)
            return rc
    print(f"{' '.join(command)}: median {statistics.median(times):.3f} s over {ns.n} runs "
          f"({min(times):.3f}..{max(times):.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
