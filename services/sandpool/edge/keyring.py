"""The set of trusted keys in force: PEM files fixed at start, plus a JWKS document kept fresh.

The JWKS document (a file or a URL) is re-read every `auth_jwks_refresh_seconds`
and, at most once per `MIN_REFRESH_INTERVAL`, when a token names a kid nobody
knows yet (a key that was just rotated in). A failed refresh keeps the last
good set: a JWKS endpoint that blips must not lock every tenant out. Every
change bumps `generation`, which tells the verifier to drop its cache (a key
that was removed must stop admitting tokens it signed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx

from sandpool.core.settings import ConfigurationError
from sandpool.edge.keys import TrustedKey, load_pem_public_key, parse_jwks

log = logging.getLogger(__name__)

MIN_REFRESH_INTERVAL = 10.0
JWKS_FETCH_TIMEOUT = 5.0
JWKS_MAX_BYTES = 1024 * 1024


class KeyRing:
    def __init__(self, pem_paths: list[str], jwks: str | None = None) -> None:
        self._static = [load_pem_public_key(p) for p in pem_paths]
        self._jwks_location = jwks
        self._jwks_keys: list[TrustedKey] = []
        self._jwks_stamp: tuple[int, int] | None = None
        self._by_kid: dict[str, TrustedKey] = {}
        self._last_attempt = 0.0
        self._lock = asyncio.Lock()
        self.generation = 0
        if jwks and not self.is_url:
            self._load_file_now()
        self._rebuild()

    @property
    def is_url(self) -> bool:
        return bool(self._jwks_location and self._jwks_location.startswith(("http://", "https://")))

    def _rebuild(self) -> None:
        by_kid: dict[str, TrustedKey] = {}
        for key in self._static + self._jwks_keys:
            if key.kid in by_kid and by_kid[key.kid].key != key.key:
                log.warning("two trusted keys share a kid; keeping the first", extra={"kid": key.kid})
                continue
            by_kid.setdefault(key.kid, key)
        if set(by_kid) != set(self._by_kid) or any(by_kid[k] != self._by_kid[k] for k in by_kid):
            self.generation += 1
        self._by_kid = by_kid

    def get(self, kid: str) -> TrustedKey | None:
        return self._by_kid.get(kid)

    def for_algorithm(self, algorithm: str) -> list[TrustedKey]:
        return [k for k in self._by_kid.values() if k.algorithm == algorithm]

    def kids(self) -> list[str]:
        return sorted(self._by_kid)

    def __len__(self) -> int:
        return len(self._by_kid)

    def _load_file_now(self) -> None:
        """A JWKS file is configuration: read it while the app is built, so a bad one stops the start."""
        assert self._jwks_location is not None
        try:
            keys = self._read_file(Path(self._jwks_location))
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"--auth-jwks {self._jwks_location}: cannot load ({exc})") from None
        if not keys and not self._static:
            raise ConfigurationError(f"--auth-jwks {self._jwks_location}: no usable public key")
        self._jwks_keys = keys or []

    async def start(self, client: httpx.AsyncClient | None) -> None:
        """First load of the JWKS document: a failure here stops the start when no PEM key is trusted."""
        if not self._jwks_location:
            return
        ok = await self.refresh(client, force=True)
        if not ok and not self._static:
            raise ConfigurationError(f"--auth-jwks {self._jwks_location}: could not load any usable key")

    async def refresh(self, client: httpx.AsyncClient | None, *, force: bool = False) -> bool:
        """Re-read the JWKS document; True when a JWKS set is in force afterwards (worth a retry)."""
        if not self._jwks_location:
            return False
        async with self._lock:
            now = time.monotonic()
            # A file is cheap to re-check (a stat); a URL is throttled so unknown kids cannot flood it.
            if not force and self.is_url and now - self._last_attempt < MIN_REFRESH_INTERVAL:
                return bool(self._jwks_keys)
            self._last_attempt = now
            try:
                keys = await self._load(client)
            except (OSError, ValueError, httpx.HTTPError) as exc:
                log.warning("JWKS refresh failed; keeping the last good keys",
                            extra={"jwks": self._jwks_location, "error": str(exc) or type(exc).__name__})
                return bool(self._jwks_keys)
            if keys is not None:
                if not keys:
                    log.warning("JWKS document has no usable key; keeping the last good keys",
                                extra={"jwks": self._jwks_location})
                    return bool(self._jwks_keys)
                self._jwks_keys = keys
                before = self.generation
                self._rebuild()
                if self.generation != before:
                    log.info("trusted keys changed", extra={"kids": sorted(self._by_kid)})
            return True

    async def _load(self, client: httpx.AsyncClient | None) -> list[TrustedKey] | None:
        assert self._jwks_location is not None
        if self.is_url:
            if client is None:
                raise ValueError("no HTTP client for a JWKS URL")
            response = await client.get(self._jwks_location, timeout=JWKS_FETCH_TIMEOUT)
            response.raise_for_status()
            if len(response.content) > JWKS_MAX_BYTES:
                raise ValueError("JWKS document too large")
            return parse_jwks(response.json(), source=self._jwks_location)
        return self._read_file(Path(self._jwks_location))

    def _read_file(self, path: Path) -> list[TrustedKey] | None:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._jwks_stamp and self._jwks_keys:
            return None
        if st.st_size > JWKS_MAX_BYTES:
            raise ValueError("JWKS document too large")
        keys = parse_jwks(json.loads(path.read_text()), source=str(path))
        self._jwks_stamp = stamp
        return keys

    async def refresh_forever(self, client: httpx.AsyncClient | None, interval: float) -> None:
        """Background loop owned by the app's lifespan."""
        while True:
            await asyncio.sleep(interval)
            await self.refresh(client, force=True)
