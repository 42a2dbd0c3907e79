"""Kubernetes quantities (`250m`, `1Gi`): how pools files and provider settings spell CPU and sizes."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

# A signed decimal number with an optional SI, binary or exponent suffix.
_QUANTITY = re.compile(r"^(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)"
                       r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}


def parse_quantity(text: str) -> Decimal:
    """The value of a Kubernetes quantity (`250m` -> 0.25, `1Gi` -> 1073741824)."""
    match = _QUANTITY.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 500m, 2, 256Mi, 1Gi)")
    suffix = match["suffix"] or ""
    try:
        number = Decimal(match["number"])
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    if suffix[:1] in ("e", "E"):
        return number * (Decimal(10) ** int(suffix[1:]))
    return number * _SUFFIX[suffix]


def positive_quantity(value: Any) -> Any:
    """A validator's normal form of a quantity above zero. YAML reads `cpu: 1` as an int and
    `cpu: 0.5` as a float; both are fine quantities."""
    if isinstance(value, bool):
        raise ValueError("must be a quantity such as 500m or 1Gi, not a boolean")
    if isinstance(value, (int, float)):
        value = format(Decimal(str(value)), "f")
    if not isinstance(value, str):
        raise ValueError("must be a quantity such as 500m or 1Gi")
    if parse_quantity(value) <= 0:
        raise ValueError(f"{value!r} must be greater than zero")
    return value.strip()
