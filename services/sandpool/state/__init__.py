"""Shared state in Redis: the key schema the scheduler and the proxy both import."""
