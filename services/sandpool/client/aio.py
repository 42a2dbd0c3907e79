"""The asyncio client: `AsyncClient` and the `AsyncSession` it leases; the same calls as `sync`.

    async with AsyncClient("http://127.0.0.1:8080", token=token) as client:
        async with client.session() as s:
            print((await s.run_python("print(1)")).stdout)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing, asynccontextmanager
from types import TracebackType
from typing import Any, cast

import httpx

from sandpool.client import calls
from sandpool.client.calls import Call, T, Timeouts, Upload
from sandpool.client.config import ClientConfig
from sandpool.client.errors import ConnectionFailed, ProtocolError, SandpoolClientError
from sandpool.client.events import (
    EventReader,
    ExecEvent,
    OutputCallback,
    deliver,
    event_source,
    events_of,
    is_event_stream,
    stream_headers,
)
from sandpool.client.results import ExecResult, FileInfo, OutputFile, SessionInfo, UploadResult
from sandpool.client.retry import RetryPolicy
from sandpool.client.transport import REQUEST_ID_HEADER, error_for_transport, finish_error, read_response, retry_delay
from sandpool.contract import BASH_CODE_EXECUTION, CODE_EXECUTION, TEXT_EDITOR_CODE_EXECUTION


class AsyncClient:
    """A contract v1 client for sandpool (or any backend or gateway that speaks contract v1).

    `timeout` bounds every call except Execute, whose budget is its own
    `timeout_seconds` (or the session's exec timeout in force) plus
    `exec_timeout_margin`. `max_retries` and `max_retry_wait` bound the automatic
    retries of calls that are safe to repeat (see `sandpool.client.calls`).
    Pass `http_client` to bring your own `httpx.AsyncClient` (proxies, TLS, transports);
    it is then yours to close.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        max_retries: int = 3,
        max_retry_wait: float = 30.0,
        exec_timeout_margin: float = 10.0,
        default_exec_timeout: float = 300.0,
        headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.config = ClientConfig.build(base_url, token, timeout=timeout, max_retries=max_retries,
                                         max_retry_wait=max_retry_wait, exec_timeout_margin=exec_timeout_margin,
                                         default_exec_timeout=default_exec_timeout, headers=headers)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient()
        self._sleep = asyncio.sleep

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> AsyncClient:
        """Build from `SANDPOOL_URL` and (optional) `SANDPOOL_TOKEN`, as `sandpool up` prints them."""
        base_url, token = ClientConfig.from_env(environ)
        return cls(base_url, token, **kwargs)

    @property
    def timeouts(self) -> Timeouts:
        return self.config.timeouts

    @property
    def retry_policy(self) -> RetryPolicy:
        return self.config.retry

    # --- plumbing ------------------------------------------------------------------------

    async def _run(self, call: Call[T]) -> T:
        request_id = uuid.uuid4().hex
        headers = {**self.config.headers, REQUEST_ID_HEADER: request_id}
        url = self.config.url(call.path)
        waited, attempt = 0.0, 0
        value: T | None
        err: SandpoolClientError | None
        while True:
            attempt += 1
            try:
                resp = await self._http.request(call.method, url, params=call.params, json=call.json, files=call.files,
                                          data=call.data, headers=headers, timeout=call.timeout)
            except httpx.TransportError as exc:
                value, err = None, error_for_transport(call, exc)
            else:
                answer = read_response(call, resp)  # apart: inferred against `value: T | None`, Call[T] would not match
                value, err = answer
            if err is None:
                return cast(T, value)  # None only for an absent_ok call, whose T is None
            delay = retry_delay(self.config.retry, call, err, attempt - 1, waited)
            if delay is None:
                raise finish_error(err, request_id, attempt)
            await self._sleep(delay)
            waited += delay

    async def _stream(self, call: Call[ExecResult], *, cancel_on_disconnect: bool) -> AsyncIterator[ExecEvent]:
        """A streamed Execute's events, as they arrive (`sandpool.client.events`); as `Client._stream`."""
        request_id = uuid.uuid4().hex
        headers = {**self.config.headers, REQUEST_ID_HEADER: request_id, **stream_headers(cancel_on_disconnect)}
        url = self.config.url(call.path)
        waited, attempt = 0.0, 0
        while True:
            attempt += 1
            try:
                async with self._http.stream(call.method, url, json=call.json, headers=headers,
                                             timeout=call.timeout) as resp:
                    if not is_event_stream(resp):
                        await resp.aread()
                        answer = read_response(call, resp)  # apart: unpacked directly, T is inferred wrong
                        whole, refused = answer
                        if refused is not None:
                            raise finish_error(refused, request_id, attempt)
                        if whole is None:
                            raise finish_error(ProtocolError("Execute answered no result"), request_id, attempt)
                        for piece in events_of(whole):
                            yield piece
                        return
                    reader = EventReader()
                    async with aclosing(event_source(resp).aiter_sse()) as events:  # closed now, not at GC
                        async for sse in events:
                            event = reader.event(sse)
                            if event is not None:
                                yield event
                            if reader.finished:
                                return
                    raise finish_error(ProtocolError("the stream ended before its result"), request_id, attempt)
            except SandpoolClientError as raised:
                if raised.request_id is None:
                    finish_error(raised, request_id, attempt)
                raise
            except httpx.TransportError as exc:
                failure = error_for_transport(call, exc)
            delay = retry_delay(self.config.retry, call, failure, attempt - 1, waited) \
                if isinstance(failure, ConnectionFailed) else None
            if delay is None:
                raise finish_error(failure, request_id, attempt)
            await self._sleep(delay)
            waited += delay

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- sessions ------------------------------------------------------------------------

    async def create_session(self, *, idle_timeout_seconds: int | None = None, max_lifetime_seconds: int | None = None,
                       image: str | None = None, **extra: Any) -> AsyncSession:
        """CreateSession. Retried on 503/429 within the retry budget; raises `AtCapacity` when it runs out.

        The caller owns the session: call `destroy()` (or use `session()`).
        """
        info = await self._run(calls.create_session(self.timeouts, idle_timeout_seconds=idle_timeout_seconds,
                                              max_lifetime_seconds=max_lifetime_seconds, image=image, **extra))
        return AsyncSession(self, info)

    @asynccontextmanager
    async def session(self, *, idle_timeout_seconds: int | None = None, max_lifetime_seconds: int | None = None,
                image: str | None = None, **extra: Any) -> AsyncIterator[AsyncSession]:
        """A session destroyed when the block exits, however it exits."""
        s = await self.create_session(idle_timeout_seconds=idle_timeout_seconds,
                                      max_lifetime_seconds=max_lifetime_seconds, image=image, **extra)
        async with s:
            yield s

    def attach(self, session_id: str) -> AsyncSession:
        """A `Session` for an id leased earlier (by this process or another)."""
        return AsyncSession(self, SessionInfo(session_id=session_id))

    async def destroy_session(self, session_id: str) -> None:
        """DestroySession; an unknown id is not an error (it is already gone)."""
        await self._run(calls.destroy_session(self.timeouts, session_id))


class AsyncSession:
    """One leased session. Interpreter state and files persist across its calls until `destroy()`."""

    def __init__(self, client: AsyncClient, info: SessionInfo) -> None:
        self.client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.session_id

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            await self.destroy()
        except SandpoolClientError:
            if exc is None:
                raise
            # The block's own error is the one worth seeing; the server reaps the session anyway.

    async def destroy(self) -> None:
        await self.client.destroy_session(self.id)

    # --- Execute -------------------------------------------------------------------------

    def _exec_call(self, tool: str, tool_input: dict[str, Any], timeout_seconds: int | None,
                   tool_use_id: str | None) -> Call[ExecResult]:
        return calls.execute(self.client.timeouts, self.id, tool, tool_input, timeout_seconds=timeout_seconds,
                             tool_use_id=tool_use_id, session_exec_timeout=self.info.exec_timeout_seconds,
                             session_max_exec_timeout=self.info.max_exec_timeout_seconds)

    async def execute(self, tool: str, tool_input: dict[str, Any], *, timeout_seconds: int | None = None,
                      tool_use_id: str | None = None, on_stdout: OutputCallback | None = None,
                      on_stderr: OutputCallback | None = None) -> ExecResult:
        """Execute any tool kind. Never retried automatically once sent (it is not idempotent).

        With `on_stdout` / `on_stderr` (plain functions), the call is streamed and each piece of output
        is handed to them as the program writes it; the result is returned at the end as usual."""
        if on_stdout is None and on_stderr is None:
            return await self.client._run(self._exec_call(tool, tool_input, timeout_seconds, tool_use_id))
        async for event in self.stream(tool, tool_input, timeout_seconds=timeout_seconds, tool_use_id=tool_use_id):
            deliver(event, on_stdout, on_stderr)
            if event.result is not None:
                return event.result
        raise ProtocolError("the stream ended before its result")  # (the stream raises first)

    def stream(self, tool: str, tool_input: dict[str, Any], *, timeout_seconds: int | None = None,
               tool_use_id: str | None = None, cancel_on_disconnect: bool = False) -> AsyncIterator[ExecEvent]:
        """Execute with its output streamed: `async for event in ...`, the `result` event last.

        Leaving the loop early closes the connection; the call runs on in the sandbox unless
        `cancel_on_disconnect` asked the server to cancel it then (see also `cancel()`)."""
        return self.client._stream(self._exec_call(tool, tool_input, timeout_seconds, tool_use_id),
                                   cancel_on_disconnect=cancel_on_disconnect)

    async def cancel(self) -> bool:
        """Stop the call running in this session now, as its timeout would. True when a call was
        stopped (its result says `cancelled`), False when none was running."""
        stopped = await self.client._run(calls.cancel_exec(self.client.timeouts, self.id))
        return stopped

    async def run_python(self, code: str, *, timeout_seconds: int | None = None, tool_use_id: str | None = None,
                         on_stdout: OutputCallback | None = None,
                         on_stderr: OutputCallback | None = None) -> ExecResult:
        """Run code in the session's persistent Python interpreter (streamed to `on_stdout` /
        `on_stderr` when given)."""
        return await self.execute(CODE_EXECUTION, {"code": code}, timeout_seconds=timeout_seconds,
                                  tool_use_id=tool_use_id, on_stdout=on_stdout, on_stderr=on_stderr)

    run_code = run_python

    async def run_bash(self, command: str, *, timeout_seconds: int | None = None, tool_use_id: str | None = None,
                       on_stdout: OutputCallback | None = None,
                       on_stderr: OutputCallback | None = None) -> ExecResult:
        """Run a shell command in the session's workspace (streamed to `on_stdout` / `on_stderr` when given)."""
        return await self.execute(BASH_CODE_EXECUTION, {"command": command}, timeout_seconds=timeout_seconds,
                                  tool_use_id=tool_use_id, on_stdout=on_stdout, on_stderr=on_stderr)

    def stream_code(self, code: str, *, timeout_seconds: int | None = None, tool_use_id: str | None = None,
                    cancel_on_disconnect: bool = False) -> AsyncIterator[ExecEvent]:
        """Python with its output streamed: `async for event in s.stream_code(...)`, the `result` last."""
        return self.stream(CODE_EXECUTION, {"code": code}, timeout_seconds=timeout_seconds,
                           tool_use_id=tool_use_id, cancel_on_disconnect=cancel_on_disconnect)

    def stream_bash(self, command: str, *, timeout_seconds: int | None = None, tool_use_id: str | None = None,
                    cancel_on_disconnect: bool = False) -> AsyncIterator[ExecEvent]:
        """A shell command with its output streamed, as `stream_code`."""
        return self.stream(BASH_CODE_EXECUTION, {"command": command}, timeout_seconds=timeout_seconds,
                           tool_use_id=tool_use_id, cancel_on_disconnect=cancel_on_disconnect)

    async def edit(self, command: str, path: str, *, timeout_seconds: int | None = None, tool_use_id: str | None = None,
             **fields: Any) -> ExecResult:
        """The text editor: `command` is view, create, str_replace, insert or undo_edit."""
        return await self.execute(TEXT_EDITOR_CODE_EXECUTION, calls.editor_input(command, path, **fields),
                            timeout_seconds=timeout_seconds, tool_use_id=tool_use_id)

    async def view(self, path: str, view_range: tuple[int, int] | list[int] | None = None) -> ExecResult:
        return await self.edit("view", path, view_range=list(view_range) if view_range is not None else None)

    async def create(self, path: str, file_text: str) -> ExecResult:
        return await self.edit("create", path, file_text=file_text)

    async def str_replace(self, path: str, old_str: str, new_str: str) -> ExecResult:
        return await self.edit("str_replace", path, old_str=old_str, new_str=new_str)

    async def insert(self, path: str, insert_line: int, new_str: str) -> ExecResult:
        return await self.edit("insert", path, insert_line=insert_line, new_str=new_str)

    async def undo_edit(self, path: str) -> ExecResult:
        return await self.edit("undo_edit", path)

    # --- files ---------------------------------------------------------------------------

    async def upload(self, path: str, data: Upload) -> UploadResult:
        """PutFile: write `data` (bytes or a binary file) to `path` in the workspace.

        Over the server's cap it raises `PayloadTooLarge` and nothing is written.
        """
        return await self.client._run(calls.put_file(self.client.timeouts, self.id, path, data))

    async def download(self, path: str) -> bytes:
        """GetFile: the bytes of `path` in the workspace."""
        return await self.client._run(calls.get_file(self.client.timeouts, self.id, path))

    async def list_files(self, path: str = ".") -> list[FileInfo]:
        """ListFiles: the entries of a workspace directory."""
        return await self.client._run(calls.list_files(self.client.timeouts, self.id, path))

    async def download_output(self, file: OutputFile) -> bytes:
        """The bytes of a file an execution produced (addressed by its `file_id`)."""
        return await self.download(file.file_id)

    async def produced_files(self, result: ExecResult) -> dict[str, bytes]:
        """Every file `result` produced, fetched with GetFile, keyed by its `file_id`.

        sandpool's `file_id` is the file's path in the workspace, so two files of one
        name in different directories do not collide.
        """
        return {f.file_id: await self.download_output(f) for f in result.files}


__all__ = ["AsyncClient", "AsyncSession"]
