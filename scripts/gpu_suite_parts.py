"""Split the test files into N parts of about equal test counts, one line of paths per part,
for running the suite on a GPU machine in calls of at most ten minutes each
(docs/testing-on-gpu.md). Run here, where the suite collects:

    python scripts/gpu_suite_parts.py 2 > parts.txt
    bash scripts/gpu_suite.sh -o addopts="" -p xdist -n 15 -v -rfEs $(sed -n 1p parts.txt)
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter


def main() -> None:
    parts = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "--collect-only", "-q", "tests"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    counts = Counter(line.split("::")[0] for line in listing.splitlines() if "::" in line)
    groups: list[list[str]] = [[] for _ in range(parts)]
    sizes = [0] * parts
    for path, n in counts.most_common():  # largest first, each to the smallest part so far
        i = sizes.index(min(sizes))
        groups[i].append(path)
        sizes[i] += n
    for group in groups:
        print(" ".join(sorted(group)))


if __name__ == "__main__":
    main()
