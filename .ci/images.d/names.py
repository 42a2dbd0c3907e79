"""Print the image references the chart's defaults name, as shell assignments for .ci/images.

    python3 names.py CHART_DIR

One place: `image.repository` and `sandboxImage.repository` in values.yaml, with
their `tag`, or the chart's `appVersion` when the tag is empty (what the chart's
`sandpool.imageRef` helper renders). Standard library only (the host may have no
PyYAML), so it reads just these flat keys; tests/chart/test_chart_images.py
checks the result against helm's own rendering.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def block(text: str, key: str) -> dict[str, str]:
    """The scalar children of a top-level mapping `key:` (two-space indented)."""
    match = re.search(rf"^{re.escape(key)}:\s*\n((?:(?:  .*|\s*#.*)?\n)+)", text, re.MULTILINE)
    if match is None:
        raise SystemExit(f"names.py: no top-level `{key}:` in values.yaml")
    out = {}
    for line in match.group(1).splitlines():
        child = re.match(r"^  ([A-Za-z]+):\s*(.*?)\s*$", line)
        if child:
            out[child.group(1)] = child.group(2).strip("\"'")
    return out


def main() -> None:
    chart = Path(sys.argv[1])
    values = (chart / "values.yaml").read_text()
    app_version = re.search(r"^appVersion:\s*\"?([^\"\s]+)\"?", (chart / "Chart.yaml").read_text(), re.MULTILINE)
    if app_version is None:
        raise SystemExit("names.py: no appVersion in Chart.yaml")
    for var, key in (("CONTROL_PLANE_IMAGE", "image"), ("SANDBOX_IMAGE", "sandboxImage")):
        image = block(values, key)
        repository, tag = image.get("repository", ""), image.get("tag", "") or app_version.group(1)
        if not re.fullmatch(r"[a-z0-9]+([._/-][a-z0-9]+)*", repository) or not re.fullmatch(r"[\w][\w.-]{0,127}", tag):
            raise SystemExit(f"names.py: {key}.repository {repository!r} / tag {tag!r} is not an image name")
        print(f"{var}={repository}:{tag}")


if __name__ == "__main__":
    main()
