"""Corrupt every hash of the first pin of a lock file, in place (for the hash-mismatch check).

    python3 tamper.py LOCK_FILE

The first pin is the first package pip fetches, so a build with the corrupted
lock must fail within seconds, at that package, with pip's hash error.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def main() -> None:
    path = Path(sys.argv[1])
    lines = path.read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if re.match(r"^[A-Za-z0-9].*==", line))
    changed, i = 0, first + 1
    while i < len(lines) and lines[i].startswith((" ", "\t")):
        lines[i], n = re.subn(r"(--hash=sha256:)([0-9a-f]{64})",
                              lambda m: m.group(1) + "".join("0" if c != "0" else "1" for c in m.group(2)), lines[i])
        changed += n
        i += 1
    if not changed:
        raise SystemExit(f"tamper.py: the first pin of {path} has no hash")
    path.write_text("".join(lines))
    print(lines[first].split()[0])


if __name__ == "__main__":
    main()
