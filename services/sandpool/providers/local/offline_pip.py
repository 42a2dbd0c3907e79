"""`pip` inside a local sandbox environment: says at once that nothing can be installed, and why.

Not imported by sandpool: the environment build (`environments.py`) copies this
source into each environment as its `pip` package and `bin/pip*`, in place of the
real pip. A sandbox has no network and its environment is read-only, so the real
pip could only fail, after retries and timeouts, with a message about connections.
This one answers `pip install` in milliseconds with the reason and what to do, and
still answers what can be answered offline (`list`, `freeze`, `show`, `--version`).
Standard library only: it runs on the environment's interpreter.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata

NO_NETWORK = (
    "ERROR: pip cannot {what} here: this sandbox has no network access, and its Python "
    "environment is read-only.\n"
    "The packages it has are listed by `pip list`. To get another one, the operator adds it to "
    "the environment's requirements lock (sandpool's docs/sandboxes.md, \"Adding packages\"); "
    "pure-Python code can also be uploaded to the workspace and imported from there.\n"
)
REFUSED = {
    "install": "install packages", "download": "download packages", "wheel": "build or download wheels",
    "index": "query a package index", "search": "search a package index", "lock": "resolve packages",
    "uninstall": "uninstall packages", "cache": "manage a download cache", "config": "change its configuration",
}
USAGE = """Usage: pip <command> [options]

This sandbox has no network access and a read-only Python environment, so this pip
only reports what is installed:

  list [--format columns|freeze|json]   installed packages
  freeze                                installed packages as name==version
  show NAME ...                         details of installed packages
  --version                             this pip and its Python
"""


def _distributions() -> list[tuple[str, str, metadata.Distribution]]:
    found: dict[str, tuple[str, str, metadata.Distribution]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in found:
            found[name.lower()] = (name, dist.version, dist)
    return sorted(found.values(), key=lambda item: item[0].lower())


def _list(args: list[str]) -> int:
    fmt = "columns"
    for i, arg in enumerate(args):
        if arg.startswith("--format="):
            fmt = arg.split("=", 1)[1]
        elif arg == "--format" and i + 1 < len(args):
            fmt = args[i + 1]
    rows = [(name, version) for name, version, _ in _distributions()]
    if fmt == "json":
        print(json.dumps([{"name": n, "version": v} for n, v in rows]))
    elif fmt == "freeze":
        print("\n".join(f"{n}=={v}" for n, v in rows))
    else:
        width = max([len("Package"), *(len(n) for n, _ in rows)])
        vwidth = max([len("Version"), *(len(v) for _, v in rows)])
        print(f"{'Package':<{width}} Version")
        print(f"{'-' * width} {'-' * vwidth}")
        for name, version in rows:
            print(f"{name:<{width}} {version}")
    return 0


def _show(names: list[str]) -> int:
    wanted = [n for n in names if not n.startswith("-")]
    if not wanted:
        sys.stderr.write("ERROR: Please provide a package name or names.\n")
        return 1
    by_name = {name.lower().replace("_", "-"): (name, version, dist) for name, version, dist in _distributions()}
    shown = 0
    for want in wanted:
        entry = by_name.get(want.lower().replace("_", "-"))
        if entry is None:
            continue
        name, version, dist = entry
        if shown:
            print("---")
        requires = sorted({r.split(";")[0].split()[0].split("[")[0].rstrip("<>=!~,(")
                           for r in (dist.requires or []) if "extra ==" not in r})
        print(f"Name: {name}\nVersion: {version}\nSummary: {dist.metadata.get('Summary') or ''}\n"
              f"Location: {dist.locate_file('')}\nRequires: {', '.join(requires)}")
        shown += 1
    if shown < len(wanted):
        missing = [w for w in wanted if w.lower().replace("_", "-") not in by_name]
        sys.stderr.write(f"WARNING: Package(s) not found: {', '.join(missing)}\n")
    return 0 if shown else 1


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options = [a for a in args if a.startswith("-")]
    words = [a for a in args if not a.startswith("-")]
    command = words[0] if words else ""
    rest = args[args.index(command) + 1:] if command else args
    if not command:
        if "--version" in options or "-V" in options:
            print(f"pip (sandpool's offline pip: no network) from {os.path.dirname(__file__)} "
                  f"(python {sys.version_info[0]}.{sys.version_info[1]})")
            return 0
        sys.stdout.write(USAGE)
        return 0 if options else 1
    if command in REFUSED:
        sys.stderr.write(NO_NETWORK.format(what=REFUSED[command]))
        return 1
    if command == "list":
        return _list(rest)
    if command == "freeze":
        return _list(["--format=freeze"])
    if command == "show":
        return _show(rest)
    if command == "help":
        sys.stdout.write(USAGE)
        return 0
    sys.stderr.write(f"ERROR: `pip {command}` is not available here. " + USAGE)
    return 1


def run() -> None:
    """The entry point of `pip` and `python -m pip`: `pip list | head` ends quietly, as pip does."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    run()
