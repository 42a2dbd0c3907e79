"""The persistent Python interpreter's worker process (stdlib only).

Started by the agent as `python -I -u -c <this source> IN_FD OUT_FD`, so it imports
nothing of sandpool and starts in a few tens of milliseconds. Program output
goes to fds 1 and 2 (pipes the agent reads); requests and completions travel on
a separate control channel (length-prefixed JSON on IN_FD/OUT_FD), so nothing a
program prints can be mistaken for framing.

Figures are files: `plt.show()`, and any pyplot figure still open when a cell
ends, writes each open figure to the workspace as `figure-N.png` (the next free N)
and closes it, as a notebook shows and closes them; the agent then lists the files
among the call's produced files. No display server is involved (MPLBACKEND=Agg).

fds 1 and 2 belong to the session, not to one cell: the runner keeps private
copies of both pipes and puts them back after every cell, so code that closes
or redirects them (`os.close(1)`, `os.dup2(f, 2)`) loses only its own output,
and the runner itself never writes a traceback into a closed descriptor.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import signal
import struct
import sys
import time
import traceback

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the runner imports little)
if TYPE_CHECKING:
    import ctypes

_HEADER = struct.Struct(">I")
_MAX_REQUEST = 64 * 1024 * 1024


class _State:
    in_user_code = False
    pid = 0
    libc: ctypes.CDLL | None = None
    stdio_copies: tuple[int, int] = (-1, -1)
    warmed = False  # a runner forked from a warmed template (runner_template.py) has paid them already


def _on_sigint(signum, frame):  # signal handler signature
    # Only user code is interrupted; a late SIGINT landing in the loop below is dropped.
    if _State.in_user_code:
        raise KeyboardInterrupt


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = os.read(fd, n - len(buf))
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(fd: int) -> dict | None:
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > _MAX_REQUEST:
        return None
    body = _read_exact(fd, size)
    return None if body is None else json.loads(body)


def _send(fd: int, message: dict) -> None:
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body)) + body
    while data:
        try:
            written = os.write(fd, data)
        except InterruptedError:
            continue
        data = data[written:]


class _Figures:
    directory = ""  # the workspace: the runner's first working directory (a cell may chdir away)
    next_number = 1


def _free_figure_path() -> str:
    number = _Figures.next_number
    while True:
        path = os.path.join(_Figures.directory, f"figure-{number}.png")
        if not os.path.lexists(path):  # never overwrite: an earlier interpreter's, or the user's own
            return path
        number += 1


def _save_figures() -> None:
    """Write every open pyplot figure to the workspace and close it; nothing when pyplot is not imported."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    try:
        from matplotlib._pylab_helpers import Gcf

        managers = sorted(Gcf.get_all_fig_managers(), key=lambda manager: manager.num)
    except Exception:  # noqa: BLE001 - a cell may have broken matplotlib; its figures are its own
        return
    for manager in managers:
        figure = manager.canvas.figure
        path = _free_figure_path()
        try:
            figure.savefig(path, format="png", bbox_inches="tight")
            _Figures.next_number = int(path.rsplit("-", 1)[1][:-4]) + 1
        except Exception as exc:  # noqa: BLE001 - a figure that cannot be drawn is reported, not fatal
            try:
                os.unlink(path)  # whatever part of it was written
            except OSError:
                pass
            _write_stderr(f"figure {manager.num} could not be saved: {type(exc).__name__}: {exc}\n")
        finally:
            try:
                pyplot.close(figure)
            except Exception:  # noqa: BLE001 - the next cell must still run; the figure is the cell's own
                pass


def _hook_show(pyplot) -> None:  # the matplotlib.pyplot module
    original = getattr(pyplot, "show", None)
    if original is None or getattr(original, "_sandpool_figures", False):
        return

    def show(*args, **kwargs):  # pyplot.show's signature
        """Figures are files here: each open figure is written to the workspace (figure-N.png) and closed."""
        _save_figures()

    show.__dict__.update(_sandpool_figures=True, __wrapped__=original)  # a marker, and the original as wraps() does
    pyplot.show = show


class _PyplotFinder:
    """Hooks `show` into matplotlib.pyplot as it is first imported, so a cell that imports it and
    calls `plt.show()` at once gets its figures as files too (a meta path finder: stdlib only)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "matplotlib.pyplot":
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is _PyplotFinder or find is None:
                continue
            try:
                spec = find(name, path, target)
            except Exception:  # noqa: BLE001 - leave the import to the regular machinery
                return None
            if spec is not None:
                break
        exec_module = getattr(getattr(spec, "loader", None), "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_hook(module):
            exec_module(module)
            _hook_show(module)

        try:
            spec.loader.exec_module = exec_and_hook  # this spec's own loader instance
        except Exception:  # noqa: BLE001 - figures left open are still saved at the end of the cell
            pass
        return spec


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - user code may have replaced or closed the stream
            pass
    try:
        if _State.libc is None:
            import ctypes

            _State.libc = ctypes.CDLL(None)
        _State.libc.fflush(None)  # C extensions' stdio buffers
    except Exception:  # noqa: BLE001 - best effort: no libc, or a cell broke its stdio
        pass


def _keep_stdio() -> None:
    """Private, close-on-exec copies of fds 1 and 2: the pipes the agent reads."""
    _State.stdio_copies = (os.dup(1), os.dup(2))


def _restore_stdio() -> None:
    """Put the session's pipes back on fds 1 and 2, and working streams on sys.stdout/stderr."""
    for fd, copy in zip((1, 2), _State.stdio_copies, strict=True):
        if copy < 0:
            continue
        try:
            os.dup2(copy, fd)  # inheritable, like the original fds 1 and 2
        except OSError:
            pass  # the cell closed our copy too; the agent notices its pipe's end
    for name, fd, errors in (("stdout", 1, "surrogateescape"), ("stderr", 2, "backslashreplace")):
        try:
            original = getattr(sys, f"__{name}__", None)
            if original is None or original.closed:
                original = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                            errors=errors, write_through=True)
                setattr(sys, f"__{name}__", original)
            if getattr(getattr(sys, name, None), "closed", True):
                setattr(sys, name, original)
        except Exception:  # noqa: BLE001 - a cell may have left anything in sys; keep serving
            pass


def _write_stderr(text: str) -> None:
    """Report to the cell's stderr whatever the cell did to sys.stderr (replaced, broken)."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    except Exception:  # noqa: BLE001 - a user object in sys.stderr may raise anything
        pass
    data = text.encode("utf-8", errors="backslashreplace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass


def _own_filename() -> str:
    # Run as `python -c <source>` by the agent (no __file__; frames say "<string>"), or as a file.
    return globals().get("__file__", "<string>")


def _print_exception(exc: BaseException) -> None:
    """The cell's traceback without the runner's own frames (they name host paths)."""
    te = traceback.TracebackException.from_exception(exc)
    own = _own_filename()
    for link in _chain(te):
        link.stack = traceback.StackSummary.from_list([f for f in link.stack if f.filename != own])
    _write_stderr("".join(te.format()))


def _chain(te: traceback.TracebackException) -> list[traceback.TracebackException]:
    out, seen = [], set()
    stack = [te]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        out.append(item)
        for nxt in (item.__cause__, item.__context__):
            if nxt is not None:
                stack.append(nxt)
    return out


_INT64 = 1 << 63


def _exit_code(exc: SystemExit) -> int:
    """`exit()`/`sys.exit()` ends the cell, not the interpreter, and answers as the contract's
    reference backend does: the code as the return code, unmasked (`exit(300)` is 300), None 0,
    whatever `int()` makes of any other code (`'7'` is 7, `2.5` is 2), else 1; nothing on stderr.
    A code outside 64 bits is 1: clients parse `return_code` as a 64-bit integer."""
    code = exc.code
    if code is None:
        return 0
    _State.in_user_code = True  # int() may run the cell's own __int__: a timeout interrupts it
    try:
        number = int(code)
    except BaseException:  # noqa: BLE001 - any code int() cannot read is a failure, as in the reference
        return 1
    finally:
        _State.in_user_code = False
    return number if -_INT64 <= number < _INT64 else 1


def run(source: str, namespace: dict) -> tuple[int, bool]:
    """Run one cell; returns (return_code, interrupted)."""
    try:
        compiled = compile(source, "<code>", "exec")
    except (SyntaxError, ValueError) as exc:
        _write_stderr("".join(traceback.format_exception(type(exc), exc, None)))
        return 1, False
    signal.signal(signal.SIGINT, _on_sigint)
    error: BaseException | None = None
    _State.in_user_code = True
    try:
        try:
            exec(compiled, namespace)  # running the caller's code is this process's job
        finally:
            _State.in_user_code = False
    except BaseException as exc:  # noqa: BLE001 - every failure of the cell is a result
        error = exc
    if os.getpid() != _State.pid:
        # A fork made by the cell finished the cell too: it must not join the request loop.
        _flush_all()
        os._exit(0)
    _restore_stdio()  # before anything is reported: the cell may have closed fds 1 and 2
    _State.in_user_code = True  # drawing a figure is the cell's work: a timeout interrupts it
    try:
        _save_figures()
    except KeyboardInterrupt as exc:
        error = error or exc
    finally:
        _State.in_user_code = False
    if error is None:
        return 0, False
    if isinstance(error, SystemExit):
        return _exit_code(error), False
    _print_exception(error)
    if isinstance(error, KeyboardInterrupt):
        return 130, True
    return 1, False


def _reap(pids: object) -> None:
    """Reap these children (the agent killed them at the process cap; as zombies they would
    keep holding slots of it). Only the named ones: others belong to the cell's own Popen objects."""
    if not isinstance(pids, list):
        return
    deadline = time.monotonic() + 1.0
    for pid in pids:
        if not isinstance(pid, int) or pid <= 0:
            continue
        while True:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] != 0:
                    break
            except (ChildProcessError, OSError):
                break
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)


def _warm(namespace: dict) -> None:
    # Pay the first-call costs (compiler, traceback formatting, ctypes) before the first call.
    if _State.warmed:
        return
    exec(compile("_ = 1\n", "<warm>", "exec"), namespace)
    namespace.pop("_", None)
    traceback.format_exception(ValueError, ValueError("warm"), None)
    _flush_all()
    _State.warmed = True


def _preimport(names: list[str]) -> None:
    """Import what the environment asks for before the first call (a failure only costs that speed-up)."""
    for name in names:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - a broken module fails the cell that imports it, as usual
            pass


def _limit(which: int, value: int) -> None:
    import resource

    hard = resource.getrlimit(which)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _prctl(libc: ctypes.CDLL):
    """libc's prctl, typed for integer arguments."""
    import ctypes

    prctl = libc.prctl
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


def _install_filter(libc: ctypes.CDLL, program: bytes) -> None:
    """Add seccomp filter `program` (struct sock_filter[], 8 bytes each) to this thread's stack."""
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(buffer))
    prctl = libc["prctl"]  # a pointer of its own: `libc.prctl` keeps its integer argtypes
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if prctl(22, 2, ctypes.addressof(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "the seccomp filter was refused")


def _harden(spec: str) -> None:
    """Harden this process as the agent's `hardening.apply` would between fork and exec, in its
    order: drop groups, gid and uid, no_new_privs, limits, seccomp last (the agent has already
    moved it into the code cgroup). Undumpable from before the drop, dumpable again only at the end,
    as an exec would have made it: nothing of the sandbox uid can reach into it in between.

    The agent starts the runner without a `preexec_fn` (so with vfork, not a fork of the whole
    agent) and verifies the result in /proc before the first call. `spec` is
    `key=value,...` (agent/hardening.py: SelfHardening.argv); a missing key is a step not asked for.
    """
    import ctypes
    import resource

    fields = dict(item.split("=", 1) for item in spec.split(",") if item)
    uid, gid = int(fields["uid"]), int(fields["gid"])
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = _prctl(libc)
    if prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0 first: the uid change alone leaves it so only
        raise OSError(ctypes.get_errno(), "PR_SET_DUMPABLE failed")  # where fs.suid_dumpable is 0
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise OSError("privilege drop did not take")
    if prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    _limit(resource.RLIMIT_CORE, 0)
    for key, which in (("nproc", resource.RLIMIT_NPROC), ("nofile", resource.RLIMIT_NOFILE),
                       ("fsize", resource.RLIMIT_FSIZE), ("as", resource.RLIMIT_AS)):
        if key in fields:
            _limit(which, int(fields[key]))
    if "seccomp" in fields:
        _install_filter(libc, bytes.fromhex(fields["seccomp"]))
    if prctl(4, 1, 0, 0, 0) != 0:  # PR_SET_DUMPABLE: its own /proc/self files its own again
        raise OSError(ctypes.get_errno(), "PR_SET_DUMPABLE failed")


def main(argv: list[str]) -> int:
    # python -I -u -c <source> [--preimport a,b] IN_FD OUT_FD, or with -S and --harden SPEC
    in_fd, out_fd = int(argv[-2]), int(argv[-1])
    options = dict(zip(argv[1:-2:2], argv[2:-2:2], strict=True))
    if "--harden" in options:
        try:
            _harden(options["--harden"])
        except BaseException as exc:  # noqa: BLE001 - not hardened: never serve a call
            _write_stderr(f"sandpool runner: cannot harden itself: {exc}\n")
            os._exit(126)
        if sys.flags.no_site:
            # The environment's site start-up (.pth files, sitecustomize) only now, as the sandbox
            # uid: what it does (a pip layer's directory in the workspace) is the sandbox's own.
            import site

            site.main()
    preimport = [name for name in options.get("--preimport", "").split(",") if name]
    os.set_inheritable(in_fd, False)
    os.set_inheritable(out_fd, False)
    _State.pid = os.getpid()
    _keep_stdio()
    signal.signal(signal.SIGINT, _on_sigint)
    sys.argv = [""]
    sys.path.insert(0, os.getcwd())  # like a notebook: modules written to the workspace import
    _Figures.directory = os.getcwd()
    sys.meta_path.insert(0, _PyplotFinder)
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins, "__doc__": None}
    _warm(namespace)
    _preimport(preimport)
    _send(out_fd, {"event": "ready", "pid": os.getpid()})
    while True:
        request = _recv(in_fd)
        if request is None:
            return 0
        if "reap" in request:
            _reap(request["reap"])
            _send(out_fd, {"event": "done", "id": request.get("id"), "return_code": 0, "interrupted": False})
            continue
        code, interrupted = run(request.get("code", ""), namespace)
        _flush_all()
        _send(out_fd, {"event": "done", "id": request.get("id"), "return_code": code, "interrupted": interrupted})


if __name__ == "__main__" and sys.argv[1:2] != ["--template"]:
    # (A runner template's source is this file's followed by runner_template.py's, which starts it.)
    sys.exit(main(sys.argv))
