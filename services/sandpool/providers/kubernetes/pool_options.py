"""What a pools file may say that only the Kubernetes provider reads, declared and checked once.

These keys sit beside the common ones in each pool of the file (`pool/templates.py` puts
every registered provider's options into the one model it validates the file with), and
reach the provider as `PoolSpec.options["kubernetes"]`, already typed. Nothing here
imports the `kubernetes` client.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sandpool.controller.quantities import positive_quantity

DEFAULT_WORKSPACE_SIZE = "1Gi"

# Label keys and values as the API server accepts them (prefix/name; value up to 63 chars).
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_LABEL_NAME})?$")


class _Strict(BaseModel):
    # A misspelt key is an error that names it, never a silently ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Toleration(_Strict):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0, alias="tolerationSeconds")

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("toleration_seconds applies only to effect NoExecute")
        return self

    def as_api(self) -> dict[str, Any]:
        """The toleration as the Kubernetes API spells it (camelCase, unset fields omitted)."""
        out: dict[str, Any] = {"operator": self.operator}
        if self.key is not None:
            out["key"] = self.key
        if self.value is not None:
            out["value"] = self.value
        if self.effect is not None:
            out["effect"] = self.effect
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


class KubernetesPoolOptions(_Strict):
    node_selector: dict[str, str] = Field(default_factory=dict, description="node labels the pool's pods need")
    tolerations: list[Toleration] = Field(default_factory=list, description="taints the pool's pods tolerate")
    workspace_size: str = Field(default=DEFAULT_WORKSPACE_SIZE, description="size limit of the workspace volume")

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a label key")
            if not isinstance(val, str) or not _LABEL_VALUE.match(val):
                raise ValueError(f"value of {key!r} is not a label value (quote it: \"true\")")
        return value

    @field_validator("workspace_size", mode="before")
    @classmethod
    def _workspace_size(cls, value: Any) -> Any:
        return positive_quantity(value)
