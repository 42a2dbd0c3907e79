"""sandpool: pool-backed, multi-tenant code-execution sandboxes (contract version 1)."""

__version__ = "0.1.0"
