"""The edge's one check of a CreateSession body: the image a workspace may use, before any lease."""

from __future__ import annotations

import json

from sandpool.contract.reasons import Reason
from sandpool.core.errors import Forbidden, Invalid
from sandpool.edge.policy import Effective


class ImageNotAllowed(Forbidden):
    reason = Reason.IMAGE_NOT_ALLOWED


class DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # Two parsers reading one body must agree on the image: a repeated key is refused, not resolved.
    document = dict(pairs)
    if len(document) != len(pairs):
        raise DuplicateKey("the CreateSession body repeats a key")
    return document


def check_image(body: bytes, effective: Effective) -> None:
    """Refuse a CreateSession naming an image outside the workspace's allow-list.

    A body this check cannot read is refused here rather than passed on: the
    session layer must never lease for an image the edge did not check. A
    request naming no image gets the operator's default pool, always allowed.
    """
    if effective.allowed_images is None:
        return
    try:
        document = json.loads(body, object_pairs_hook=_no_duplicate_keys) if body.strip() else {}
    except ValueError as exc:
        raise Invalid(str(exc) if isinstance(exc, DuplicateKey) else "the CreateSession body is not JSON") from None
    if not isinstance(document, dict):
        raise Invalid("the CreateSession body must be a JSON object")
    image = document.get("image")
    if image is None:
        return
    if not isinstance(image, str):
        raise Invalid("image must be a string")
    if image not in effective.allowed_images:
        raise ImageNotAllowed("this workspace may not use that image",
                              allowed_images=sorted(effective.allowed_images))
