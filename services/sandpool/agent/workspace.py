"""The one path check: every client path goes through `Workspace.resolve`.

Refused: empty, absolute, drive-lettered (`C:`), any `..` segment (with `/` or
`\\` as separator), NUL bytes, and anything whose real path (symlinks resolved
on both sides) lies outside the workspace; a symlink that stays inside is fine.
Because sandboxed code can swap a path for a symlink between the check and the
use, files are then opened with `O_NOFOLLOW` (and `O_NONBLOCK`, so a FIFO never
blocks the agent) and the opened descriptor's real path is checked again
through `/proc/self/fd`. Error messages name the client's path, never a host path.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from sandpool.contract.reasons import Reason
from sandpool.core.errors import (
    BadRequest,
    Invalid,
    IsADirectory,
    NotFound,
    PathOutsideWorkspace,
    PayloadTooLarge,
    SandpoolError,
    Unavailable,
)

_DRIVE = re.compile(r"^[A-Za-z]:")
_SEP = re.compile(r"[\\/]+")
_SHOWN = 200


def shown(path: str) -> str:
    """A client path fit for an error message (never a host path, never unbounded)."""
    text = path.replace("\x00", "\\0")
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


class NotRegularFile(BadRequest):
    reason = Reason.NOT_A_REGULAR_FILE


class NameTooLong(BadRequest):
    reason = Reason.NAME_TOO_LONG


class WorkspaceFull(Unavailable):
    reason = Reason.WORKSPACE_FULL


def write_error(exc: OSError, path: str) -> SandpoolError:
    """A named error for a write the file system refused (never a 500 with the host path in its log line)."""
    if exc.errno == errno.ENAMETOOLONG:
        return NameTooLong(f"a name in {shown(path)!r} is too long for the file system")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return WorkspaceFull(f"the workspace is full: {shown(path)!r} was not written", retry_after=1)
    return Unavailable(f"cannot write {shown(path)!r}: {exc.strerror or 'error'}", retry_after=1)


class Workspace:
    def __init__(self, root: str | Path, *, owner: tuple[int | None, int | None] = (None, None)) -> None:
        self.root = os.path.realpath(root)
        self._uid, self._gid = owner

    # --- the check ------------------------------------------------------------------------

    def resolve(self, path: str) -> str:
        """The real absolute path of a client path, or a refusal."""
        if not isinstance(path, str) or path == "":
            raise Invalid("path must not be empty")
        if "\x00" in path:
            raise PathOutsideWorkspace("path contains a NUL byte")
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise Invalid("path is not valid Unicode") from None
        if path.startswith(("/", "\\")) or _DRIVE.match(path):
            raise PathOutsideWorkspace(f"path {shown(path)!r} is absolute; paths are relative to the workspace")
        if ".." in _SEP.split(path):
            raise PathOutsideWorkspace(f"path {shown(path)!r} leaves the workspace")
        real = os.path.realpath(os.path.join(self.root, path))
        if not self.contains(real):
            raise PathOutsideWorkspace(f"path {shown(path)!r} resolves outside the workspace")
        return real

    def contains(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root + os.sep)

    def relative(self, real: str) -> str:
        return os.path.relpath(real, self.root)

    def _verify_fd(self, fd: int, path: str) -> None:
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = ""
        if not self.contains(real):
            os.close(fd)
            raise PathOutsideWorkspace(f"path {shown(path)!r} resolves outside the workspace")

    # --- reads ----------------------------------------------------------------------------

    def open_file(self, path: str, *, max_bytes: int) -> tuple[int, os.stat_result]:
        """An fd of a regular file inside the workspace, checked after opening."""
        real = self.resolve(path)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:
            raise NotFound(f"no such file: {shown(path)!r}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # swapped for a symlink after the check
                raise PathOutsideWorkspace(f"path {shown(path)!r} resolves outside the workspace") from None
            if exc.errno in (errno.ENOTDIR,):
                raise NotFound(f"no such file: {shown(path)!r}") from None
            raise NotRegularFile(f"cannot open {shown(path)!r}") from None
        self._verify_fd(fd, path)
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise IsADirectory(f"{shown(path)!r} is a directory")
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotRegularFile(f"{shown(path)!r} is not a regular file")
        if st.st_size > max_bytes:
            os.close(fd)
            raise PayloadTooLarge(f"{shown(path)!r} is larger than the {max_bytes}-byte read cap")
        os.set_blocking(fd, True)
        return fd, st

    def read_bytes(self, path: str, *, max_bytes: int) -> bytes:
        fd, _ = self.open_file(path, max_bytes=max_bytes)
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise PayloadTooLarge(f"{shown(path)!r} is larger than the {max_bytes}-byte read cap")
        return data

    def open_dir(self, path: str) -> tuple[int, str]:
        real = self.resolve(path)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PathOutsideWorkspace(f"path {shown(path)!r} resolves outside the workspace") from None
            raise NotFound(f"no such directory: {shown(path)!r}") from None
        self._verify_fd(fd, path)
        return fd, real

    def is_dir(self, path: str) -> bool:
        real = self.resolve(path)
        return os.path.isdir(real)

    # --- writes ---------------------------------------------------------------------------

    def _make_parents(self, real_parent: str, path: str) -> None:
        missing = []
        here = real_parent
        while not os.path.lexists(here) and self.contains(here) and here != self.root:
            missing.append(here)
            here = os.path.dirname(here)
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o755)
            except FileExistsError:
                pass
            except OSError:
                raise NotFound(f"cannot create the directories of {shown(path)!r}") from None
            if self._uid is not None:
                os.lchown(directory, self._uid, self._gid if self._gid is not None else self._uid)

    def write(self, path: str, chunks: Iterable[bytes], *, max_bytes: int) -> tuple[str, int]:
        """Write a file atomically (temp file in the target directory, then rename).

        Over `max_bytes` nothing is written: the temp file is removed and 413 raised.
        A file system refusal (name too long, workspace full) is a named error.
        Returns (workspace-relative path, size).
        """
        try:
            return self._write(path, chunks, max_bytes=max_bytes)
        except OSError as exc:
            raise write_error(exc, path) from None

    def _write(self, path: str, chunks: Iterable[bytes], *, max_bytes: int) -> tuple[str, int]:
        real = self.resolve(path)
        if real == self.root:
            raise IsADirectory(f"{shown(path)!r} is a directory")
        parent, name = os.path.split(real)
        self._make_parents(parent, path)
        dfd, _ = self.open_dir(os.path.relpath(parent, self.root))
        try:
            try:
                existing = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                existing = None
            if existing is not None and stat.S_ISDIR(existing.st_mode):
                raise IsADirectory(f"{shown(path)!r} is a directory")
            mode = stat.S_IMODE(existing.st_mode) if existing is not None and stat.S_ISREG(existing.st_mode) \
                else 0o644
            tmp = f".sandpool-tmp-{secrets.token_hex(8)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=dfd)
            size = 0
            try:
                with os.fdopen(fd, "wb", closefd=False) as fh:
                    for chunk in chunks:
                        size += len(chunk)
                        if size > max_bytes:
                            raise PayloadTooLarge(f"file over the {max_bytes}-byte cap; nothing was written")
                        fh.write(chunk)
                if self._uid is not None:
                    os.fchown(fd, self._uid, self._gid if self._gid is not None else self._uid)
                os.fchmod(fd, mode)
                os.close(fd)
                fd = -1
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
        finally:
            os.close(dfd)
        return self.relative(real), size

    def remove(self, path: str) -> None:
        real = self.resolve(path)
        parent, name = os.path.split(real)
        dfd, _ = self.open_dir(os.path.relpath(parent, self.root))
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)
