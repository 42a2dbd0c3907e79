"""The Redis settings every service that shares state declares the same way."""

from __future__ import annotations

from pydantic import Field, field_validator

from sandpool.core.settings import ServiceSettings
from sandpool.state.client import parse


class RedisSettings(ServiceSettings):
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description=(
        "Redis holding all shared state: redis://, rediss://, "
        "redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db] or "
        "redis+cluster://[:password@]host:port[,host:port...]"))
    redis_prefix: str = Field(default="sandpool", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                              description="Key prefix (and cluster hash tag) of every Redis key")
    redis_timeout_seconds: float = Field(default=5.0, gt=0, description="Timeout of every Redis command")
    redis_max_connections: int = Field(default=512, ge=4, description="Redis connections per process")

    @field_validator("redis_url")
    @classmethod
    def _a_known_form(cls, value: str) -> str:
        parse(value)  # ConfigurationError naming the forms: a start that cannot work stops here
        return value
