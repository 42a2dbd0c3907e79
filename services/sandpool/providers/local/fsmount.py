"""Size-capped workspaces: a tmpfs per sandbox, and unmounting whatever sits under a sandbox dir.

A tmpfs bounds the bytes and inodes a sandbox can write without quotas or loop
devices; its pages are charged to the memory cgroup of whoever writes them.
Unmounts are lazy (MNT_DETACH) so a process that still holds a file open cannot
stop a sandbox from being removed.
"""

from __future__ import annotations

from pathlib import Path

from sandpool.providers.local.isolation.linux import MNT_DETACH, MS_NODEV, MS_NOSUID, mount, umount2

MOUNTINFO = Path("/proc/self/mountinfo")


def mount_tmpfs(target: Path, *, size: int, uid: int, gid: int) -> None:
    inodes = max(1024, size // 4096)
    mount("sandpool-workspace", str(target), "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={size},nr_inodes={inodes},mode=0700,uid={uid},gid={gid}")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def mounts_under(directory: Path) -> list[Path]:
    """Mount points at or below `directory`, deepest first. The kernel lists a mount by its real
    path, so a `directory` reached through a symlink is resolved first."""
    base = str(directory.resolve())
    found = []
    try:
        text = MOUNTINFO.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 4:
            point = _unescape(parts[4])
            if point == base or point.startswith(base + "/"):
                found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def unmount_under(directory: Path) -> None:
    for point in mounts_under(directory):
        try:
            umount2(str(point), MNT_DETACH)
        except OSError as exc:
            if exc.errno not in (22, 2):  # EINVAL: not a mount (any more); ENOENT: gone
                raise
