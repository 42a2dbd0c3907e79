"""Compare what an image installed (`pip freeze`) with its lock file; exit 1 on any difference.

    python3 installed.py LOCK_FILE FREEZE_FILE [FREEZE_FILE_2]

The image must hold exactly the lock's `name==version` pins plus sandpool
itself: nothing missing, nothing extra, no other version. With a second freeze
(`.ci/images --reproducibility`, a second build without cache), the two must
also be identical line for line. Standard library only.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def frozen(text: str) -> tuple[dict[str, str], list[str]]:
    """name -> version of a `pip freeze`, and the lines that are not a plain pin (the project itself)."""
    pins, other = {}, []
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", line.strip())
        if match:
            pins[canonical(match.group(1))] = match.group(2)
        elif line.strip():
            other.append(line.strip())
    return pins, other


def main() -> int:
    lock = lock_pins(Path(sys.argv[1]).read_text())
    texts = [Path(p).read_text() for p in sys.argv[2:]]
    installed, other = frozen(texts[0])
    problems = []
    installed.pop("sandpool", None)
    other = [line for line in other if not canonical(line.split(" ", 1)[0].split("@")[0]) == "sandpool"]
    problems += [f"not installed: {n}=={v}" for n, v in sorted(lock.items()) if n not in installed]
    problems += [f"installed, not in the lock: {n}=={v}" for n, v in sorted(installed.items()) if n not in lock]
    problems += [f"{n}: lock {lock[n]}, installed {v}" for n, v in sorted(installed.items())
                 if n in lock and lock[n] != v]
    problems += [f"not a pinned release: {line}" for line in other]
    if len(texts) > 1 and texts[0] != texts[1]:
        first, second = set(texts[0].splitlines()), set(texts[1].splitlines())
        problems += [f"only in build 1: {line}" for line in sorted(first - second)]
        problems += [f"only in build 2: {line}" for line in sorted(second - first)]
    for problem in problems:
        print(f"images: {Path(sys.argv[1]).name}: {problem}", file=sys.stderr)
    if problems:
        return 1
    builds = " (identical in both builds)" if len(texts) > 1 else ""
    print(f"images: {Path(sys.argv[1]).name}: the image holds exactly its {len(lock)} pins and sandpool{builds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
