"""The Redis settings every service that shares state declares the same way."""

from __future__ import annotations

from pydantic import Field

from sandpool.core.settings import ServiceSettings


class RedisSettings(ServiceSettings):
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis holding all shared state")
    redis_prefix: str = Field(default="sandpool", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                              description="Key prefix (and cluster hash tag) of every Redis key")
    redis_timeout_seconds: float = Field(default=5.0, gt=0, description="Timeout of every Redis command")
    redis_max_connections: int = Field(default=512, ge=4, description="Redis connections per process")
