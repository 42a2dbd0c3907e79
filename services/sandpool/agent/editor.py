"""The text editor tool: view, create, str_replace, insert, undo_edit.

Every path goes through the workspace check. An edit that cannot apply is a
failed *result* (return code 1, a message on stderr), not an HTTP error: the
model reads it and corrects itself. Each file keeps a bounded history of its
previous contents for `undo_edit`.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from dataclasses import dataclass

from sandpool.agent.workspace import Workspace, shown
from sandpool.contract.models import TextEditorInput
from sandpool.core.errors import SandpoolError

_SNIPPET_CONTEXT = 4
_DIR_DEPTH = 2
_DIR_ENTRIES = 1000


@dataclass
class EditResult:
    stdout: str = ""
    stderr: str = ""
    return_code: int = 0


class EditFailed(Exception):
    pass


def numbered(lines: list[str], first: int) -> str:
    return "".join(f"{n:6}\t{line}\n" for n, line in enumerate(lines, start=first))


class Editor:
    def __init__(self, workspace: Workspace, *, history: int, max_bytes: int) -> None:
        self.workspace = workspace
        self.max_bytes = max_bytes
        self._history_len = history
        self._history: dict[str, deque[str | None]] = {}

    def run(self, edit: TextEditorInput) -> EditResult:
        try:
            handler = getattr(self, "_" + edit.command)
            return EditResult(stdout=handler(edit))
        except EditFailed as exc:
            return EditResult(stderr=str(exc) + "\n", return_code=1)
        except SandpoolError as exc:  # outside the workspace, not a file, too large: a failed edit
            return EditResult(stderr=exc.detail + "\n", return_code=1)

    # --- helpers --------------------------------------------------------------------------

    def _read(self, path: str) -> str:
        data = self.workspace.read_bytes(path, max_bytes=self.max_bytes)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise EditFailed(f"{shown(path)!r} is not a UTF-8 text file") from None

    def _write(self, path: str, text: str, previous: str | None) -> None:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise EditFailed("the text is not valid Unicode (a lone surrogate?)") from None
        self.workspace.write(path, [data], max_bytes=self.max_bytes)
        if self._history_len:
            key = self.workspace.resolve(path)
            self._history.setdefault(key, deque(maxlen=self._history_len)).append(previous)

    def _snippet(self, text: str, first_line: int, last_line: int) -> str:
        lines = text.split("\n")
        start = max(1, first_line - _SNIPPET_CONTEXT)
        end = min(len(lines), last_line + _SNIPPET_CONTEXT)
        return numbered(lines[start - 1:end], start)

    # --- commands -------------------------------------------------------------------------

    def _view(self, edit: TextEditorInput) -> str:
        if self.workspace.is_dir(edit.path):
            return self._view_dir(edit.path)
        text = self._read(edit.path)
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if edit.view_range is None:
            return numbered(lines, 1)
        start, end = edit.view_range
        if not 1 <= start <= max(1, len(lines)):
            raise EditFailed(f"invalid view_range: first line {start} is not in 1..{len(lines)}")
        if end == -1:
            end = len(lines)
        if end < start or end > len(lines):
            raise EditFailed(f"invalid view_range: last line {end} must be -1 or in {start}..{len(lines)}")
        return numbered(lines[start - 1:end], start)

    def _view_dir(self, path: str) -> str:
        fd, real = self.workspace.open_dir(path)
        os.close(fd)
        out: list[str] = []

        def walk(directory: str, depth: int) -> None:
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError:
                return
            for entry in entries:
                if entry.name.startswith(".") or len(out) >= _DIR_ENTRIES:
                    continue
                rel = self.workspace.relative(entry.path)
                is_dir = entry.is_dir(follow_symlinks=False)
                out.append(rel + ("/" if is_dir else ""))
                if is_dir and depth < _DIR_DEPTH:
                    walk(entry.path, depth + 1)

        walk(real, 1)
        header = f"Files and directories up to {_DIR_DEPTH} levels deep in {shown(path)}, hidden items excluded:\n"
        return header + "".join(line + "\n" for line in out)

    def _create(self, edit: TextEditorInput) -> str:
        assert edit.file_text is not None  # the contract model requires it for create
        real = self.workspace.resolve(edit.path)
        previous = None
        if os.path.lexists(real):
            if stat.S_ISDIR(os.stat(real).st_mode):
                raise EditFailed(f"{shown(edit.path)!r} is a directory")
            previous = self._read(edit.path)
        self._write(edit.path, edit.file_text, previous)
        return f"File created successfully at: {shown(edit.path)}\n"

    def _str_replace(self, edit: TextEditorInput) -> str:
        assert edit.old_str is not None and edit.new_str is not None
        text = self._read(edit.path)
        if edit.old_str == "":
            raise EditFailed("old_str must not be empty")
        count = text.count(edit.old_str)
        if count == 0:
            raise EditFailed(f"No replacement was performed: old_str did not appear verbatim in {shown(edit.path)}.")
        if count > 1:
            raise EditFailed(f"No replacement was performed: old_str appears {count} times in "
                             f"{shown(edit.path)}; it must appear exactly once.")
        at = text.index(edit.old_str)
        new_text = text[:at] + edit.new_str + text[at + len(edit.old_str):]
        self._write(edit.path, new_text, text)
        first = text[:at].count("\n") + 1
        last = first + edit.new_str.count("\n")
        return f"The file {shown(edit.path)} has been edited.\n" + self._snippet(new_text, first, last)

    def _insert(self, edit: TextEditorInput) -> str:
        assert edit.insert_line is not None and edit.new_str is not None
        text = self._read(edit.path)
        lines = text.split("\n")
        trailing = bool(lines) and lines[-1] == ""
        if trailing:
            lines.pop()
        if not 0 <= edit.insert_line <= len(lines):
            raise EditFailed(f"invalid insert_line {edit.insert_line}: must be in 0..{len(lines)}")
        new_lines = edit.new_str.split("\n")
        if new_lines and new_lines[-1] == "" and len(new_lines) > 1:
            new_lines.pop()
        merged = lines[:edit.insert_line] + new_lines + lines[edit.insert_line:]
        new_text = "\n".join(merged) + ("\n" if trailing or not text else "")
        self._write(edit.path, new_text, text)
        return (f"The file {shown(edit.path)} has been edited.\n"
                + self._snippet(new_text, edit.insert_line + 1, edit.insert_line + len(new_lines)))

    def _undo_edit(self, edit: TextEditorInput) -> str:
        key = self.workspace.resolve(edit.path)
        history = self._history.get(key)
        if not history:
            raise EditFailed(f"no edit to undo for {shown(edit.path)}")
        previous = history.pop()
        if previous is None:
            self.workspace.remove(edit.path)
            return f"Undid the creation of {shown(edit.path)}.\n"
        self.workspace.write(edit.path, [previous.encode("utf-8")], max_bytes=self.max_bytes)
        return f"Last edit to {shown(edit.path)} undone.\n"
