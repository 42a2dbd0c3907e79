"""Seccomp filter for sandboxed code (filled in by the isolation work; a no-op until then)."""

from __future__ import annotations


def install_filter() -> bool:
    """Install the filter in the calling process; False when unavailable on this host."""
    return False
