"""Answers rendered from the contract's models, so a server's body is the shape its model declares."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import Response


class ModelResponse(Response):
    """A model as the JSON body (pydantic's compact encoding, UTF-8, as `JSONResponse` writes it).

    `exclude_unset`: leave out the optional fields nobody gave a value (a handle shows what its
    record holds; a `null` the record holds is shown)."""

    media_type = "application/json"

    def __init__(self, model: BaseModel, status_code: int = 200, headers: Mapping[str, str] | None = None, *,
                 exclude_unset: bool = False, background: BackgroundTask | None = None) -> None:
        super().__init__(model.model_dump_json(exclude_unset=exclude_unset), status_code=status_code,
                         headers=headers, background=background)
