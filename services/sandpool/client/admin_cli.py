"""`sandpool admin`: the admin API from a terminal, so an operator never needs curl.

    sandpool admin usage [--workspace W] [--from D --to D]
    sandpool admin sessions [--workspace W]
    sandpool admin policy get W
    sandpool admin policy set W key=value...      (null clears a field; changes only the fields named;
                                                   lists are comma-separated: egress_allow=pypi.org,x.org)
    sandpool admin revoke <token or jti>
    sandpool admin end-session <session id>

The URL comes from `--url` or `SANDPOOL_URL`, the token from `SANDPOOL_TOKEN`,
`--token-file` or `--token` (which shows in the process list). Output is a
readable table; `--json` prints the API's JSON for scripts. Failures are one
line on stderr (exit 1): refused token, missing admin scope, unreachable server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from sandpool.client.admin import AdminClient, expired, token_claims
from sandpool.client.config import TOKEN_ENV, URL_ENV
from sandpool.client.errors import (
    ConnectionFailed,
    Forbidden,
    InvalidRequest,
    NotFound,
    ResponseTimeout,
    SandpoolClientError,
    Unauthorized,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("admin", help="the admin API: usage, sessions, policies, revocation",
                                   description=__doc__.split("\n\n")[0],
                                   epilog=f"Environment: {URL_ENV}, {TOKEN_ENV}.")
    parser.add_argument("--url", default=None, help=f"sandpool's URL [default: ${URL_ENV}]")
    parser.add_argument("--token", default=None, help=f"bearer token (shows in the process list; prefer "
                                                      f"${TOKEN_ENV} or --token-file)")
    parser.add_argument("--token-file", type=Path, default=None, help="file holding the bearer token")
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    commands = parser.add_subparsers(dest="admin_command", metavar="ACTION")
    commands.required = True

    usage = commands.add_parser("usage", help="a workspace's usage (totals, per tool, per day)")
    usage.add_argument("--workspace", help="default: the token's workspace")
    usage.add_argument("--from", dest="start", help="first UTC day, YYYY-MM-DD")
    usage.add_argument("--to", dest="end", help="last UTC day (default today)")

    sessions = commands.add_parser("sessions", help="a workspace's live sessions")
    sessions.add_argument("--workspace", help="default: the token's workspace")

    policy = commands.add_parser("policy", help="read or change a workspace's policy (admin)")
    actions = policy.add_subparsers(dest="policy_action", metavar="get|set")
    actions.required = True
    get = actions.add_parser("get", help="the stored policy, what is in force, and the ceilings")
    get.add_argument("workspace")
    put = actions.add_parser("set", help="change fields: max_concurrent_sessions=5 allowed_images=python,node "
                                              "egress_allow=pypi.org,files.pythonhosted.org")
    put.add_argument("workspace")
    put.add_argument("changes", nargs="+", metavar="key=value")

    revoke = commands.add_parser("revoke", help="revoke a token (the token itself, or its jti)")
    revoke.add_argument("token_or_jti")

    end = commands.add_parser("end-session", help="end any workspace's session (admin)")
    end.add_argument("session_id")
    parser.set_defaults(func=run)


class Refused(Exception):
    """A failure told to the operator in one line."""


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        try:
            return args.token_file.read_text().strip() or None
        except OSError as exc:
            raise Refused(f"cannot read --token-file {args.token_file}: {exc.strerror}") from None
    if args.token:
        return str(args.token)
    from sandpool.core.settings import environ

    return environ().get(TOKEN_ENV) or None


def _url(args: argparse.Namespace) -> str:
    from sandpool.core.settings import environ

    url = args.url or environ().get(URL_ENV)
    if not url:
        raise Refused(f"no URL: pass --url or set {URL_ENV} (sandpool up prints it)")
    return str(url)


LIST_FIELDS = ("allowed_images", "egress_allow")
"""Policy fields that are lists: comma-separated on the command line."""


def parse_changes(changes: list[str]) -> dict[str, Any]:
    """`key=value` pairs: integers, `null`, and comma-separated lists for allowed_images and egress_allow."""
    out: dict[str, Any] = {}
    for change in changes:
        key, sep, value = change.partition("=")
        if not sep or not key:
            raise Refused(f"{change!r} is not key=value")
        if value in ("null", "none", ""):
            out[key] = None
        elif key in LIST_FIELDS:
            out[key] = [v.strip() for v in value.split(",") if v.strip()]
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise Refused(f"{key}: {value!r} is not an integer (or null)") from None
    return out


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _when(epoch: Any) -> str:
    if not isinstance(epoch, (int, float)):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(epoch))


def _figure(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def show_usage(data: dict[str, Any]) -> str:
    total = data["total"]
    plain = {k: v for k, v in total.items() if k != "by_tool"}
    out = [f"workspace {data['workspace']}", _table([[k, _figure(v)] for k, v in sorted(plain.items())],
                                                    ["counter", "total"])]
    by_tool = total.get("by_tool") or {}
    if by_tool:
        out.append(_table([[tool, f.get("executions", 0), _figure(f.get("execution_seconds", 0))]
                           for tool, f in sorted(by_tool.items())], ["tool", "executions", "execution_seconds"]))
    for day in data.get("days") or []:
        counters = {k: v for k, v in day["counters"].items() if k != "by_tool" and v}
        out.append(f"{day['day']}: " + (", ".join(f"{k}={_figure(v)}" for k, v in sorted(counters.items()))
                                        or "nothing"))
    return "\n\n".join(out)


def show_sessions(data: dict[str, Any]) -> str:
    rows = [[s["session_id"], s.get("pool"), _when(s.get("created_at")), _when(s.get("last_activity_at")),
             _when(s.get("deadline"))] for s in data["sessions"]]
    if not rows:
        return f"workspace {data['workspace']}: no live session"
    return _table(rows, ["session", "pool", "created", "last activity", "ends at"])


def show_policy(data: dict[str, Any]) -> str:
    policy, effective, ceilings = data["policy"], data["effective"], data["ceilings"]
    names = sorted(set(effective["limits"]) | set(ceilings))
    rows = [[name, policy.get(name), effective["limits"].get(name, 0) or "none", ceilings.get(name, 0) or "none"]
            for name in names]
    images = effective.get("allowed_images")
    egress = effective.get("egress_allow") or []
    ceiling = data.get("egress_ceiling")
    return (f"workspace {data['workspace']}\n" + _table(rows, ["limit", "stored", "in force", "ceiling"])
            + f"\n\nallowed images: {', '.join(images) if images is not None else 'any'}"
            + f"\negress allowed to: {', '.join(egress) if egress else 'nowhere'}"
            + f" (installation ceiling: {', '.join(ceiling) if ceiling else 'no egress'})")


def execute(admin: AdminClient, args: argparse.Namespace) -> tuple[Any, str]:
    """Run the action; (the API's JSON, the readable rendering)."""
    action = args.admin_command
    if action == "usage":
        data = admin.usage(workspace=args.workspace, start=args.start, end=args.end)
        return data, show_usage(data)
    if action == "sessions":
        data = admin.sessions(workspace=args.workspace)
        return data, show_sessions(data)
    if action == "policy":
        if args.policy_action == "get":
            data = admin.policy(args.workspace)
        else:
            data = admin.update_policy(args.workspace, **parse_changes(args.changes))
        return data, show_policy(data)
    if action == "revoke":
        given = args.token_or_jti
        try:
            claims = token_claims(given)
        except ValueError:
            data = admin.revoke(given)
            return data, f"revoked jti {data['jti']} until {_when(data['expires_at'])}"
        jti = claims.get("jti")
        if not isinstance(jti, str) or not jti:
            raise Refused("that token has no jti claim, so it cannot be revoked by id")
        if expired(claims):
            return {"jti": jti, "expired": True}, f"token {jti} has already expired: nothing to revoke"
        data = admin.revoke(jti, expires_at=claims.get("exp"))
        return data, f"revoked jti {data['jti']} until {_when(data['expires_at'])}"
    data = admin.end_session(args.session_id)
    return data, (f"ended session {data['session_id']} of workspace {data['workspace']} "
                  f"after {data['session_seconds']:.1f}s")


def explain(exc: SandpoolClientError, url: str) -> str:
    """One line an operator can act on."""
    if isinstance(exc, ConnectionFailed):
        return f"cannot reach sandpool at {url} (is it running? check --url / {URL_ENV})"
    if isinstance(exc, ResponseTimeout):
        return f"sandpool at {url} did not answer in time"
    if isinstance(exc, Unauthorized):
        cause = (exc.body or {}).get("cause") or "refused"
        return f"the token was refused ({cause}): mint a new one with `sandpool token --workspace W --admin`"
    if isinstance(exc, Forbidden):
        return f"not allowed: {exc.detail or exc} (an admin token has the admin scope: sandpool token --admin)"
    if isinstance(exc, NotFound):
        return f"not found: {exc.detail or exc}"
    if isinstance(exc, InvalidRequest):
        return f"refused: {exc.detail if isinstance(exc.detail, str) else exc}"
    return f"failed: {exc}"


def run(args: argparse.Namespace) -> int:
    try:
        url = _url(args)
        with AdminClient(url, _token(args)) as admin:
            try:
                data, shown = execute(admin, args)
            except SandpoolClientError as exc:
                raise Refused(explain(exc, url)) from None
    except (Refused, ValueError) as exc:
        print(f"sandpool admin: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else shown)
    return 0
