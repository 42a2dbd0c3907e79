"""What a pools file may say that only the local provider reads: nothing yet.

A local pool runs on its `image` (an environment name) within `resources.limits`, both
fields every provider shares (`pool.provider.PoolSpec`). The class exists so that the
registry treats every provider alike; a local-only key would be declared here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class LocalPoolOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
