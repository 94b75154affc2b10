"""A fork server: a process that imported a program once and forks a child per request, each a
process of its own running the program as if it had been started alone.

A request (a JSON line on the server's request pipe) gives the child's ``argv``, ``env`` and
``cwd``, where its stdin, stdout and stderr go (a file's path, or none: the server's own), and
its ``name``. The child takes them (``PYTHONPATH`` first on its path), names itself
(``PR_SET_NAME``: its command line is still the server's), runs the program's main with
``argv``, and ends as an interpreter ends: non-daemon threads joined, ``atexit`` hooks run,
exit status as Python's (``SystemExit``, else 0, or 1 after a traceback). Nothing is
connected or started in the server, so each child starts from the program merely imported;
:func:`run_module` is the main that runs ``-m MODULE ARGS`` as ``python -m`` would.

A request is one of two kinds:

- *run* (the default): the child is the server's; the server answers its pid, waits for it,
  then answers its exit status, one request at a time;
- *hand over*: the child becomes a child of the server's parent, which must be a child
  subreaper (``PR_SET_CHILD_SUBREAPER``): the server forks a go-between that forks the child
  and exits, so the child is re-parented to the subreaper above it. The server answers its pid
  at once, and the parent waits for it as for any child of its own (:class:`Child`). The
  go-between can first make a time namespace (``boottime_ahead``: the child's boot-time
  clock that many seconds ahead of the host's, its monotonic clock the host's).

A child dies with its parent (the server, or for one handed over its new parent:
``PR_SET_PDEATHSIG``) unless the request says ``die_with_parent: false``. A server ends when
its request pipe is closed, once the child it waits for (if any) has ended.

:class:`Server` is the client: it starts a server as a fresh interpreter (``start``), or forks
one from the calling process (``fork``), whose children then have whatever that process had
imported.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_GET_CHILD_SUBREAPER = 37
_CLONE_NEWTIME = 0x80
_NAME_LENGTH = 15  # a process's name (/proc/PID/comm), without its terminating NUL

Main = Callable[[list[str]], object]


class Channel:
    """JSON messages, one a line, over two pipes: the end this side reads, the end it writes."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self._buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self.write_fd, data) :]

    def receive(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message: ``TimeoutError`` if none came within ``timeout`` seconds,
        ``EOFError`` once the other side has closed its end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        return message

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class Child:
    """A process handed over to this one, now its parent: what ``subprocess.Popen`` offers of
    it (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``), by
    ``waitpid`` as ``Popen`` does (a child reaped by someone else's ``waitpid(-1)`` ends with
    status 0, its own lost, as with ``Popen``)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._waiting = threading.Lock()

    def poll(self) -> int | None:
        if self.returncode is None and self._waiting.acquire(blocking=False):
            try:
                if self.returncode is None:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                    if pid == self.pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                self.returncode = 0
            finally:
                self._waiting.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status once it has ended (``subprocess.TimeoutExpired`` after ``timeout``
        seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not reaped: the pid is still this child's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """The client of a fork server (see the module's docstring); one request at a time,
    whichever thread makes it."""

    def __init__(self, process: subprocess.Popen[bytes] | Child, channel: Channel) -> None:
        self.process = process
        self.channel = channel
        self._turn = threading.Lock()

    @classmethod
    def start(cls, command: list[str], cwd: Path | str = REPO) -> Server:
        """A server started as ``command``: a fresh interpreter that calls :func:`serve` with
        its stdin and stdout as the channel (``python -m tests.forked_cli PROGRAM``)."""
        requests_read, requests_write = os.pipe()
        answers_read, answers_write = os.pipe()
        try:
            process = subprocess.Popen(command, cwd=cwd, stdin=requests_read, stdout=answers_write)
        finally:
            os.close(requests_read)
            os.close(answers_write)
        return cls(process, Channel(answers_read, requests_write))

    @classmethod
    def fork(cls, main: Main) -> Server:
        """A server forked from this process, serving ``main``: call it before this process
        connects to anything or starts a thread, once it has imported what the children need."""
        requests_read, requests_write = os.pipe()
        answers_read, answers_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(requests_write)
                os.close(answers_read)
                name_process("fork server")
                serve(main, Channel(requests_read, answers_write))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(requests_read)
        os.close(answers_write)
        return cls(Child(pid, ["fork server"]), Channel(answers_read, requests_write))

    def run(
        self,
        argv: list[str],
        name: str,
        env: dict[str, str] | None = None,
        cwd: Path | str | None = None,
        files: tuple[str | None, str | None, str | None] = (os.devnull, None, None),
        timeout: float | None = None,
        die_with_parent: bool = True,
        started: Callable[[int], None] | None = None,
    ) -> int:
        """Fork a child of the server's that runs ``argv`` (``files``: its stdin, stdout and
        stderr, ``None`` for the server's); its exit status once it has ended (``started`` is
        told its pid first). After ``timeout`` seconds the child is killed, and
        ``subprocess.TimeoutExpired`` raised once the server has reaped it."""
        request = _request(argv, name, env, cwd, files, die_with_parent=die_with_parent)
        with self._turn:
            self.channel.send(request)
            pid = int(self._answer()["pid"])
            if started is not None:
                started(pid)
            try:
                return int(self._answer(timeout)["code"])
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._answer()
                raise subprocess.TimeoutExpired(argv, timeout or 0) from None

    def spawn(
        self,
        argv: list[str],
        name: str,
        env: dict[str, str] | None = None,
        cwd: Path | str | None = None,
        files: tuple[str | None, str | None, str | None] = (os.devnull, None, None),
        boottime_ahead: int | None = None,
    ) -> Child:
        """Fork a child that runs ``argv`` and is handed over to this process, which must be
        a child subreaper and must be the server's parent; it dies with this process."""
        subreaper = ctypes.c_int()
        ctypes.CDLL(None).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(subreaper), 0, 0, 0)
        if not subreaper.value:
            raise RuntimeError("a child is handed over to a child subreaper only")
        request = _request(argv, name, env, cwd, files, hand_over=True)
        request["boottime_ahead"] = boottime_ahead
        with self._turn:
            self.channel.send(request)
            answer = self._answer()
        if "error" in answer:
            raise OSError(f"the fork server could not start {name}: {answer['error']}")
        return Child(int(answer["pid"]), argv)

    def close(self, timeout: float = 5.0) -> None:
        """End the server: at once if it waits for no child, else once that child ends
        (waited for up to ``timeout`` seconds)."""
        with self._turn:
            self.channel.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)

    def kill(self) -> None:
        """End the server now (its children that die with it, too)."""
        self.process.kill()
        self.process.wait()
        self.channel.close()

    def _answer(self, timeout: float | None = None) -> dict[str, Any]:
        try:
            return self.channel.receive(timeout)
        except EOFError:
            raise RuntimeError("the fork server ended") from None


def _request(
    argv: list[str],
    name: str,
    env: dict[str, str] | None,
    cwd: Path | str | None,
    files: tuple[str | None, str | None, str | None],
    **options: object,
) -> dict[str, Any]:
    return {
        "argv": argv,
        "name": name,
        "env": dict(os.environ if env is None else env),
        "cwd": str(cwd or os.getcwd()),
        "files": list(files),
        **options,
    }


def serve(main: Main, channel: Channel) -> None:
    """Answer the requests that come through ``channel`` until its other side closes it."""
    parent = os.getppid()  # the process children are handed over to
    while True:
        try:
            request = channel.receive()
        except EOFError:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if request.get("hand_over"):
            channel.send(_hand_over(main, request, channel, parent))
            continue
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(main, request, channel, server)
        try:
            channel.send({"pid": pid})
            channel.send({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])})
        except BrokenPipeError:  # the client has gone (a campaign worker killed): so do we
            os.waitpid(pid, 0)
            return


def _hand_over(
    main: Main, request: dict[str, Any], channel: Channel, parent: int
) -> dict[str, Any]:
    """Fork the child through a go-between, which exits: the child is re-parented to the
    subreaper above the server, ``parent``. What to answer: its pid, or the go-between's
    error."""
    read, write = os.pipe()
    between = os.fork()
    if between == 0:
        try:
            os.close(read)
            if request.get("boottime_ahead") is not None:
                boot_clock_ahead(int(request["boottime_ahead"]))
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(write)
                _child(main, request, channel, parent, handed_from=me)
            answer: dict[str, Any] = {"pid": pid}
        except BaseException as error:
            answer = {"error": repr(error)}
        try:
            os.write(write, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as said:
        answer = json.loads(said.read() or b'{"error": "the go-between died"}')
    os.waitpid(between, 0)
    return answer


def _child(
    main: Main,
    request: dict[str, Any],
    channel: Channel,
    parent: int,
    handed_from: int | None = None,
) -> NoReturn:
    """In the forked child: take the request's files, parent, environment, directory and name,
    run ``main``, and end as an interpreter would."""
    code = 1
    try:
        _take_files(request["files"])
        for fd in (channel.read_fd, channel.write_fd):
            if fd > 2:  # else a file taken has replaced it
                os.close(fd)
        if handed_from is not None:
            while os.getppid() == handed_from:  # until the go-between has exited
                time.sleep(0.0005)
        if request.get("die_with_parent", True):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # it died before the line above, or is no subreaper
            print(f"fork server: {request['name']} lost its parent {parent}", file=sys.stderr)
            os._exit(1)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(str(request["cwd"]))
        sys.path[:0] = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
        name_process(str(request["name"]))
        try:
            main(list(request["argv"]))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (1 if exit_.code else 0)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        _finalise()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _take_files(paths: list[str | None]) -> None:
    """Open stdin, stdout and stderr on the paths given (the same path once for both outputs,
    which then share an offset; stdin on its own, to read), inherited by what the child
    executes; ``None`` keeps the server's."""
    opened: dict[tuple[str, bool], int] = {}
    for fd, path in enumerate(paths):
        if path is None:
            continue
        key = (path, fd == 0)
        if key not in opened:
            flags = os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            opened[key] = os.open(path, flags, 0o644)
        os.dup2(opened[key], fd)
        os.set_inheritable(fd, True)
    for target in opened.values():
        if target > 2:
            os.close(target)


def _finalise() -> None:
    """What an interpreter does at its end before it goes: wait for its non-daemon threads,
    then run its ``atexit`` hooks (sqllocker's gives back the locks still held)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    finally:
        atexit._run_exitfuncs()


def run_module(argv: list[str]) -> None:
    """``python -m MODULE ARGS`` (``argv``: ``["-m", MODULE, *ARGS]``) in this process: the
    module run afresh as ``__main__`` (what it imports may already be imported)."""
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit(f"fork server: not -m MODULE [ARGS...]: {argv}")
    module = argv[1]
    if not hasattr(sys.modules.get(module), "__path__"):  # a package runs its __main__
        sys.modules.pop(module, None)
    sys.argv = [module, *argv[2:]]  # run_module makes argv[0] the module's path
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def module_name(argv: list[str]) -> str:
    """The name a child running ``-m MODULE ...`` takes: the module's last part."""
    return argv[1].rpartition(".")[2][:_NAME_LENGTH]


def name_process(name: str) -> None:
    """This process's name (``/proc/PID/comm``, what ``ps`` shows without its arguments)."""
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name[:_NAME_LENGTH].encode(), 0, 0, 0)


def process_name(pid: int) -> str:
    """The name of process ``pid``, empty if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def boot_clock_ahead(seconds: int) -> None:
    """Make this process's children start in a new time namespace (as ``unshare --time``)
    whose CLOCK_BOOTTIME is ``seconds`` ahead of the host's, and whose CLOCK_MONOTONIC is the
    host's (Linux 5.6, and root); an ``execve`` takes this process into it too."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWTIME) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWTIME)")
    with open("/proc/self/timens_offsets", "w") as offsets:
        offsets.write(f"boottime {seconds} 0\n")
