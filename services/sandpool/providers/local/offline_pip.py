"""`pip` inside a local sandbox environment: installs into the session's own layer where the policy allows
it, and otherwise says at once that nothing can be installed, and why.

Not imported by sandpool: the environment build (`environments.py`) copies this
source into each environment as its `pip` package and `bin/pip*`, in place of the
real pip. The environment is shared by every sandbox and read-only.

- In an environment built with `pip: true` (it holds a real pip under
  `share/sandpool/pip`), in a sandbox with egress (the agent set `https_proxy`
  and `SANDBOX_PIP_LAYER`), every command goes to that real pip, and `install`
  installs into the layer (`--prefix $SANDBOX_PIP_LAYER`), which the environment's
  site hook puts on sys.path. Whether the package index may be reached is the
  egress proxy's word: pip retries a refused index once (`PIP_RETRIES=1`), and a
  refusal is repeated as the last line, naming the policy (`egress_allow`).
- Otherwise `pip install` is answered in milliseconds with the reason (no egress
  for this sandbox, or an environment not marked `pip: true`) and what to do,
  and what can be answered offline still is (`list`, `freeze`, `show`, `--version`).

Standard library only: it runs on the environment's interpreter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata

NO_NETWORK = (
    "ERROR: pip cannot {what} here: this sandbox has no network access, and its Python "
    "environment is read-only.\n"
    "The packages it has are listed by `pip list`. To get another one, the operator adds it to "
    "the environment's requirements lock (sandpool's docs/sandboxes.md, \"Adding packages\"); "
    "pure-Python code can also be uploaded to the workspace and imported from there.\n"
)
NO_EGRESS = (
    "ERROR: pip cannot {what} here: this sandbox has no network access (no egress proxy serves it), and its "
    "Python environment is read-only.\n"
    "This environment can install packages per session (it is marked `pip: true`) in a sandpool whose "
    "operator runs the egress proxy and whose workspace policy allows the package index (egress_allow; "
    "sandpool's docs/egress.md). The packages it has are listed by `pip list`.\n"
)
NOT_PIP_ENABLED = (
    "ERROR: pip cannot {what} here: this sandbox's Python environment is shared and read-only, and not marked "
    "`pip: true` (which would let a session install into a layer of its own).\n"
    "The packages it has are listed by `pip list`. To get another one, the operator adds it to the "
    "environment's requirements lock, or marks the environment `pip: true` in the pools file and allows the "
    "package index in the workspace's egress_allow (sandpool's docs/sandboxes.md and docs/egress.md).\n"
)
REFUSED_BY_POLICY = (
    "ERROR: the package index could not be reached: {reason}. An admin allows it for the workspace, e.g. "
    "`sandpool admin policy set <workspace> egress_allow=pypi.org,files.pythonhosted.org` (within the "
    "installation's egress ceiling; sandpool's docs/egress.md).\n"
)
REFUSAL = re.compile(r"sandpool egress: .*?(?:\((?:workspace policy egress_allow|operator setting "
                     r"egress_allow_ceiling)\)|whatever the allow-list says|its session has ended)")
"""An egress proxy refusal as pip reports it (inside the repr of an exception): the proxy's whole sentence."""
REAL_PIP = os.path.join("share", "sandpool", "pip", "pip", "__pip-runner__.py")
LAYER_OPTIONS = ("--target", "-t", "--prefix", "--root")
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
        print(f"Name: {name}\nVersion: {version}\nSummary: {(dist.metadata.get_all('Summary') or [''])[0]}\n"
              f"Location: {dist.locate_file('')}\nRequires: {', '.join(requires)}")
        shown += 1
    if shown < len(wanted):
        missing = [w for w in wanted if w.lower().replace("_", "-") not in by_name]
        sys.stderr.write(f"WARNING: Package(s) not found: {', '.join(missing)}\n")
    return 0 if shown else 1


def _real_pip() -> str | None:
    """The real pip of a `pip: true` environment (its runner), or None."""
    runner = os.path.join(sys.prefix, REAL_PIP)
    return runner if os.path.isfile(runner) else None


def _egress() -> bool:
    return bool(os.environ.get("https_proxy") or os.environ.get("HTTPS_PROXY"))


def _layered(args: list[str], command: str, layer: str) -> list[str]:
    """`install` goes into the session's layer unless the caller chose a place (`--user` means the layer)."""
    if command != "install" or any(a in LAYER_OPTIONS or a.startswith(tuple(o + "=" for o in LAYER_OPTIONS[::2]))
                                   for a in args):
        return args
    args = [a for a in args if a != "--user"]
    at = args.index("install") + 1
    return args[:at] + ["--prefix", layer, "--no-warn-script-location"] + args[at:]


def delegate(runner: str, layer: str, args: list[str], command: str) -> int:
    """Run the real pip; its output passes through, and an egress refusal is repeated as the last word."""
    env = dict(os.environ)
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    argv = [sys.executable, "-I", runner, *_layered(args, command, layer)]
    try:
        proc = subprocess.Popen(argv, stderr=subprocess.PIPE, env=env)
    except OSError as exc:
        sys.stderr.write(f"ERROR: pip could not start: {exc}\n")
        return 1
    refusal = None
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.decode(errors="replace")
        sys.stderr.write(line)
        sys.stderr.flush()
        found = REFUSAL.search(line)
        if found:
            refusal = found.group(0)
    code = proc.wait()
    if code != 0 and refusal is not None:
        if "egress_allow" in refusal:
            sys.stderr.write(REFUSED_BY_POLICY.format(reason=refusal))
        else:
            sys.stderr.write(f"ERROR: the package index could not be reached: {refusal}\n")
    return code


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options = [a for a in args if a.startswith("-")]
    words = [a for a in args if not a.startswith("-")]
    command = words[0] if words else ""
    rest = args[args.index(command) + 1:] if command else args
    runner, layer = _real_pip(), os.environ.get("SANDBOX_PIP_LAYER")
    if runner is not None and layer and _egress():
        return delegate(runner, layer, args, command)
    if not command:
        if "--version" in options or "-V" in options:
            print(f"pip (sandpool's offline pip: no network) from {os.path.dirname(__file__)} "
                  f"(python {sys.version_info[0]}.{sys.version_info[1]})")
            return 0
        sys.stdout.write(USAGE)
        return 0 if options else 1
    if command in REFUSED:
        reason = NO_EGRESS if runner is not None else NOT_PIP_ENABLED if _egress() else NO_NETWORK
        sys.stderr.write(reason.format(what=REFUSED[command]))
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
