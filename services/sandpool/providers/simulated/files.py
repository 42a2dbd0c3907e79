"""A simulated sandbox's workspace: files kept in memory, with the real agent's path rules and caps.

Paths are checked as the agent checks them (empty, absolute, drive-lettered and `..` paths
refused) and normalised, so a benchmark's file calls take the same branches through the api;
there is no file system behind them, hence no symlinks to resolve.
"""

from __future__ import annotations

import posixpath
import re
import time
from dataclasses import dataclass, field

from sandpool.contract.models import FileEntry, FileListing
from sandpool.contract.reasons import Reason
from sandpool.core.errors import Invalid, IsADirectory, NotFound, PathOutsideWorkspace, PayloadTooLarge, Unavailable

_DRIVE = re.compile(r"^[A-Za-z]:")
_SEP = re.compile(r"[/\\]")
LIST_LIMIT = 10_000


class WorkspaceFull(Unavailable):
    reason = Reason.WORKSPACE_FULL


def checked(path: str) -> str:
    """The workspace-relative, normalised form of a client path, or the agent's refusal."""
    if not path:
        raise Invalid("path must not be empty")
    if "\x00" in path:
        raise PathOutsideWorkspace("path contains a NUL byte")
    if path.startswith(("/", "\\")) or _DRIVE.match(path):
        raise PathOutsideWorkspace("path is absolute; paths are relative to the workspace")
    if ".." in _SEP.split(path):
        raise PathOutsideWorkspace("path leaves the workspace")
    return posixpath.normpath(path.replace("\\", "/"))


@dataclass
class MemoryWorkspace:
    max_bytes: int
    files: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    used: int = 0

    def write(self, path: str, data: bytes) -> str:
        rel = checked(path)
        if rel == "." or any(name.startswith(rel + "/") for name in self.files):
            raise IsADirectory(f"{rel!r} is a directory")
        old = len(self.files.get(rel, (b"", 0.0))[0])
        if self.used - old + len(data) > self.max_bytes:
            raise WorkspaceFull(f"the workspace is full: {rel!r} was not written", retry_after=1)
        self.files[rel] = (data, time.time())
        self.used += len(data) - old
        return rel

    def read(self, path: str, *, max_bytes: int) -> bytes:
        rel = checked(path)
        found = self.files.get(rel)
        if found is None:
            if self._is_dir(rel):
                raise IsADirectory(f"{rel!r} is a directory")
            raise NotFound(f"no such file: {rel!r}")
        if len(found[0]) > max_bytes:
            raise PayloadTooLarge(f"{rel!r} is larger than the {max_bytes}-byte read cap")
        return found[0]

    def listing(self, path: str) -> FileListing:
        rel = checked(path)
        if not self._is_dir(rel):
            raise NotFound(f"no such directory: {rel!r}")
        prefix = "" if rel == "." else rel + "/"
        entries: dict[str, FileEntry] = {}
        for name, (data, mtime) in self.files.items():
            if not name.startswith(prefix):
                continue
            head, sep, _ = name[len(prefix):].partition("/")
            entry_path = prefix + head
            if sep:
                entries.setdefault(entry_path, FileEntry(path=entry_path, size_bytes=0, type="directory",
                                                         modified_at=mtime))
            else:
                entries[entry_path] = FileEntry(path=entry_path, size_bytes=len(data), type="file",
                                                modified_at=mtime)
        files = sorted(entries.values(), key=lambda e: e.path)
        return FileListing(files=files[:LIST_LIMIT], truncated=len(files) > LIST_LIMIT)

    def _is_dir(self, rel: str) -> bool:
        return rel == "." or any(name.startswith(rel + "/") for name in self.files)
