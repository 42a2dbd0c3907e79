"""Hand-written hypothesis strategies for the contract's requests, and the checks every answer must pass.

The apps' OpenAPI documents name the operations and their path parameters but not
the bodies (the contract's bodies are parsed by hand so a bad one gets the
contract's status, not FastAPI's), so each operation found in `app.openapi()` is
mapped here to a strategy for its query, body and headers. `operations_of(app)`
is what the tests check their coverage against: a new endpoint without a
strategy fails the coverage test instead of going unfuzzed.

Generated programs are harmless on purpose: bash commands only ever print their
(quoted) random text, Python code is either a fixed snippet, a `print(repr(...))`
or random text that is not a program. The fuzzing is of the service's parsing and
confinement, not of what a program may do (that is tests/security's job).
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any
from urllib.parse import quote

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

LONG = os.environ.get("SANDPOOL_LONG") == "1"


def fuzz_settings(examples: int) -> settings:
    """Per test (never a global profile: other suites' hypothesis tests keep theirs). CI runs a
    derandomised, bounded number of examples so a run is reproducible; SANDPOOL_LONG=1 runs 20x
    as many, randomised."""
    return settings(
        max_examples=examples * 20 if LONG else examples,
        derandomize=not LONG,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                               HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
        # no explain phase: its report imports a module whose DeprecationWarning the suite turns into an error
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    )

TOOLS = ["code_execution", "bash_code_execution", "text_editor_code_execution"]
EDITOR_COMMANDS = ["view", "create", "str_replace", "insert", "undo_edit"]

# Any code point, lone surrogates included (json.dumps escapes them; a server must refuse them cleanly).
ANY_CHAR = st.characters(codec=None, exclude_categories=())
texts = st.text(ANY_CHAR, max_size=24)
short_texts = st.text(ANY_CHAR, max_size=8)

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(allow_nan=False, allow_infinity=False), texts)
json_any = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(short_texts, inner, max_size=3), max_leaves=8)

NAME_CHARS = st.characters(codec=None, exclude_categories=(), exclude_characters="/")
path_parts = st.one_of(
    st.sampled_from(["..", ".", "", "a", "dir", "notes.txt", "link_out", "link_root", "pipe", "~", "%2e%2e",
                     "..\\..", "C:", "c:x", "\x00", " ", "NUL", ".hidden", "a" * 300]),
    st.text(NAME_CHARS, min_size=1, max_size=10),
)


plain_names = st.text(st.characters(codec="utf-8", exclude_characters="/\\\x00:", exclude_categories=("Cs", "Cc")),
                      min_size=1, max_size=10).filter(lambda n: n not in (".", ".."))
plain_paths = st.lists(plain_names, min_size=1, max_size=3).map("/".join)


def paths(canary: str | None = None) -> st.SearchStrategy[str]:
    """Plain relative paths (half the time), and dotted, empty, backslashed, NUL-bearing, symlinked ones;
    absolute ones only under `canary`."""
    relative = st.lists(path_parts, max_size=5).map("/".join)
    hostile = [relative, st.sampled_from(["", ".", "/", "//", "\\", "..", "../..", "/etc/passwd",
                                          "link_root/etc/passwd", "link_out", "pipe", "dir"])]
    if canary:
        hostile.append(st.lists(st.text(NAME_CHARS, min_size=1, max_size=8), max_size=2)
                       .map(lambda parts: "/".join([canary, "secret.txt", *parts]) if parts
                            else canary + "/secret.txt"))
        hostile.append(st.just("../canary/secret.txt"))
    return st.one_of(plain_paths, st.sampled_from(["notes.txt", "dir/new.txt", "made.txt"]), *hostile)


# Header values a conforming HTTP parser accepts (visible ASCII, space, tab, obs-text): a control
# character is refused by the HTTP server itself (uvicorn's plain-text 400) before any app sees it.
header_texts = st.text(st.characters(codec="latin-1", exclude_characters="\x7f",
                                     exclude_categories=("Cc",)) | st.just("\t"), max_size=40)

def pct(text: str) -> str:
    """Percent-encode any text, lone surrogates included (as the invalid UTF-8 they would be on the wire)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def query(params: dict[str, str]) -> str:
    return "&".join(f"{pct(k)}={pct(v)}" for k, v in params.items())


session_ids = st.one_of(st.sampled_from(["s1", "..", ".", "%2F", "a" * 300, "-", "\x00"]),
                        st.text(ANY_CHAR, min_size=1, max_size=16)).map(lambda s: pct(s).replace(".", "%2E"))
# (dots encoded too: a client would otherwise normalise "/sessions/.." to "/" before sending it)

SAFE_CODE = ["print(1)", "1/0", "import sys; sys.exit(3)", "x = 41\nprint(x + 1)", "print('é' * 3)",
             "raise SystemExit('bye')", "print(end='')",
             "import sys; sys.stdout.write('\\udcff'.encode('utf-8', 'surrogatepass').decode('utf-8', 'replace'))",
             "open('made.txt', 'w').write('x')", "print(open('notes.txt').read())"]
SAFE_BASH = ["echo hi", "true", "false", "exit 3", "ls", "echo $((6*7))", "cat notes.txt",
             "printf '\\xff\\xfe'", "echo err >&2"]

printed = texts.map(lambda t: f"print({t!r})")
echoed = texts.map(lambda t: "printf %s " + shlex.quote(t))
codes = st.one_of(st.sampled_from(SAFE_CODE), printed, texts, json_any)
commands = st.one_of(st.sampled_from(SAFE_BASH), echoed, st.just(""), json_any)
timeouts = st.one_of(st.integers(min_value=-5, max_value=10**12), st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from([1, 5, 0, "5", True]), st.none(), json_any)


def editor_inputs(path_strategy: st.SearchStrategy[str], *, wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    anything = (lambda strategy: st.one_of(strategy, json_any)) if wild else (lambda strategy: strategy)
    optional = {"file_text": anything(texts), "old_str": anything(texts), "new_str": anything(texts),
                "insert_line": anything(st.integers(min_value=-10, max_value=2**64)),
                "view_range": anything(st.lists(st.integers(min_value=-5, max_value=2**40), min_size=2, max_size=2))}
    if wild:
        optional["extra_field"] = json_any
    return st.fixed_dictionaries(
        {"command": anything(st.sampled_from(EDITOR_COMMANDS)) if not wild else st.one_of(
            st.sampled_from(EDITOR_COMMANDS), texts, json_any),
         "path": anything(path_strategy)}, optional=optional)


def exec_documents(path_strategy: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """Mostly well-formed calls (so the tools really run), and wild documents around them."""
    def for_tool(args: tuple[Any, bool]) -> st.SearchStrategy[Any]:
        tool, wild = args
        if tool == "code_execution":
            inner = st.fixed_dictionaries({"code": codes if wild else st.sampled_from(SAFE_CODE) | printed})
        elif tool == "bash_code_execution":
            inner = st.fixed_dictionaries({"command": commands if wild else st.sampled_from(SAFE_BASH) | echoed})
        elif tool == "text_editor_code_execution":
            inner = editor_inputs(path_strategy, wild=wild)
        else:
            inner = json_any
        optional: dict[str, st.SearchStrategy[Any]] = {
            "timeout_seconds": timeouts if wild else st.integers(min_value=1, max_value=10),
            "tool_use_id": st.one_of(texts, json_any) if wild else texts}
        if wild:
            optional["unknown_field"] = json_any
        return st.fixed_dictionaries(
            {"tool": st.just(tool), "input": st.one_of(inner, json_any) if wild and tool in TOOLS else inner},
            optional=optional)

    valid = st.tuples(st.sampled_from(TOOLS), st.just(False)).flatmap(for_tool)
    wild = st.tuples(st.one_of(st.sampled_from(TOOLS), texts, json_scalars), st.just(True)).flatmap(for_tool)
    return st.one_of(valid, valid, valid, wild, json_any)


def encoded(documents: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """JSON bodies (ASCII-escaped or not, NaN allowed), and raw bytes that are not JSON at all."""
    def dump(args: tuple[Any, bool]) -> bytes:
        doc, ascii_only = args
        try:
            return json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
        except (ValueError, OverflowError):
            return b"{"
    dumped = st.tuples(documents, st.booleans()).map(dump)
    return st.one_of(dumped, dumped, dumped, st.binary(max_size=64),
                     st.sampled_from([b"", b"null", b"[]", b'{"tool":', b"\xff\xfe{}", b'{"a":1e999999}',
                                      b'{"tool": "code_execution", "tool": "bash_code_execution"}']))


content_types = st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1",
                                 "multipart/form-data", "", "application/x-www-form-urlencoded"])


def uploads(path_strategy: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    """httpx keyword arguments for a PutFile: mostly well-formed multipart, odd fields, raw bodies."""
    well_formed = st.fixed_dictionaries({
        "files": st.fixed_dictionaries({"file": st.tuples(st.one_of(path_strategy, st.just("up.bin")),
                                                          st.binary(max_size=128))}),
        "data": st.fixed_dictionaries({}, optional={"path": path_strategy}),
    })
    odd = st.fixed_dictionaries({
        "files": st.dictionaries(st.sampled_from(["file", "files", "path", "x"]),
                                 st.tuples(st.one_of(path_strategy, st.none()), st.binary(max_size=128)),
                                 min_size=0, max_size=2),
        "data": st.dictionaries(st.sampled_from(["path", "file", "mode"]), st.one_of(path_strategy, texts),
                                max_size=2),
    })
    raw = st.fixed_dictionaries({
        "content": st.one_of(st.binary(max_size=128),
                             st.just(b"--xyz\r\nContent-Disposition: form-data; "
                                     b"name=\"file\"; filename=\"a\"\r\n\r\n")),
        "headers": st.fixed_dictionaries({"Content-Type": st.sampled_from(
            ["multipart/form-data; boundary=xyz", "multipart/form-data", "application/octet-stream",
             "multipart/form-data; boundary=" + "b" * 80, "text/plain"])}),
    })
    return st.one_of(well_formed, well_formed, odd, raw)


# --- what every answer must be ---------------------------------------------------------------

def check_answer(response: Any, *, forbidden: tuple[str, ...] = (), allowed_5xx: tuple[str, ...] = ()) -> None:
    """No 500 (nor any 5xx but named, reasoned ones); every 4xx says why; no traceback, no host path."""
    status = response.status_code
    text = response.text
    if status >= 300:  # a 200's stdout/stderr is the program's own (a Python error prints a traceback)
        assert "Traceback" not in text, (status, text[:500])
    for needle in forbidden:
        assert needle not in text, (status, needle, text[:500])
    if status >= 500:
        body = _json(response)
        assert isinstance(body, dict) and body.get("reason") in allowed_5xx, (status, text[:500])
    if 400 <= status < 500:
        body = _json(response)
        assert isinstance(body, dict), (status, text[:500])
        assert "detail" in body and isinstance(body.get("reason"), str) and body["reason"], (status, text[:500])


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def operations_of(app: Any) -> set[tuple[str, str]]:
    """(METHOD, path template) of every operation an app documents."""
    spec = app.openapi()
    return {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}


# --- strategies from an OpenAPI document's JSON schemas ------------------------------------------

def from_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that satisfy a (FastAPI-generated) JSON schema, edge values favoured.

    Covers what the apps' documents use: $ref, anyOf, object (properties, required,
    additionalProperties), array, string (length bounds), integer/number (bounds),
    boolean, null. Unknown shapes fall back to any JSON.
    """
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components))
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, components) for s in schema["anyOf"]))
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        strategy = st.fixed_dictionaries({k: from_schema(v, components) for k, v in props.items() if k in required},
                                         optional={k: from_schema(v, components) for k, v in props.items()
                                                   if k not in required})
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            strategy = st.tuples(strategy, st.dictionaries(short_texts, from_schema(extra, components), max_size=3)) \
                .map(lambda pair: {**pair[1], **pair[0]})
        return strategy
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        edge = [low, high] if high is not None else [low]
        return st.one_of(st.text(ANY_CHAR, min_size=low, max_size=min(high or 24, 24)),
                         st.sampled_from(edge).map(lambda n: "a" * n))
    if kind in ("integer", "number"):
        low, high = schema.get("minimum"), schema.get("maximum")
        low_i = int(low) if low is not None else None
        high_i = int(high) if high is not None else None
        edges = [v for v in (low_i, high_i) if v is not None]
        base = st.integers(min_value=low_i, max_value=high_i)
        return st.one_of(base, st.sampled_from(edges)) if edges else base
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return json_any


def near_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Mostly valid documents, and documents one step off (any JSON, a field of the wrong type)."""
    valid = from_schema(schema, components)
    mutated = st.tuples(valid, short_texts, json_any).map(
        lambda t: {**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[2])
    return st.one_of(valid, valid, mutated, json_any)
