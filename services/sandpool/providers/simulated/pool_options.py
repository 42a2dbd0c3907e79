"""The pools-file keys only the simulating provider reads: none (every pool is simulated alike)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SimulatedPoolOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
