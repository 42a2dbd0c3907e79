"""Which files a code or bash call created or changed, for the result's file references.

A bounded walk before and after the call (hidden directories and `__pycache__`
skipped, symlinks not followed) compared by (inode, size, mtime, ctime). An empty
workspace costs one `scandir`; a large one is capped at `scan_limit` entries.
"""

from __future__ import annotations

import os
import stat

Snapshot = dict[str, tuple[int, int, int, int]]

_SKIPPED_DIRS = {"__pycache__"}


def snapshot(root: str, scan_limit: int) -> Snapshot:
    found: Snapshot = {}
    seen = 0
    stack = [root]
    while stack and seen < scan_limit:
        directory = stack.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    seen += 1
                    if seen > scan_limit:
                        break
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        if not entry.name.startswith(".") and entry.name not in _SKIPPED_DIRS:
                            stack.append(entry.path)
                    elif stat.S_ISREG(st.st_mode) and not entry.name.startswith(".sandpool-tmp-"):
                        found[os.path.relpath(entry.path, root)] = (st.st_ino, st.st_size, st.st_mtime_ns,
                                                                    st.st_ctime_ns)
        except OSError:
            continue
    return found


def changed(before: Snapshot, after: Snapshot, limit: int) -> list[dict[str, str]]:
    """File references, newest first, at most `limit`."""
    paths = [p for p, sig in after.items() if before.get(p) != sig]
    paths.sort(key=lambda p: (-after[p][2], p))
    return [{"type": "code_execution_output", "file_id": p, "filename": os.path.basename(p)}
            for p in paths[:limit]]
