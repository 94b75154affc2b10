"""SQLite: waiters of one lockstring queue in the kernel, on a byte of a file beside the database.

Every process of an SQLite database runs on one machine, so the kernel can order them. Each
lockstring has a byte in ``<database>-sqllocker-queue`` (at a 62-bit hash of table and
lockstring), and whoever holds that byte's lock, its *place*, is the one waiter that tries for
the row; it keeps the place while it holds the row. A release deletes the row and then gives
the place up, and the kernel wakes a waiter blocked on it at once: the next holder inserts its
row without polling. A newcomer that finds the place taken waits for it rather than trying the
row, so it cannot slip in between a release and the next waiter's INSERT.

A lock taken at once (``wait=0``, no waiting) takes no place: an uncontended cycle would pay
a lock taken and left on the byte for nothing. Its release looks whether someone holds the
place (``F_OFD_GETLK``, which takes nothing): a waiter that came meanwhile took it and, its
turn come, waits for the row; the release then rings the bell for turns (below), which only
such waiters hear, and the waiter reads the row and inserts. The waiters behind it stay
blocked on the place, so none of them passes it. The locks of a group (``lock_all``), and one
a queued waiter won by a look at the row, without its place, hold none either, and their
releases look and ring the same way.

The row is still the lock; the place only says who tries. A holder that stopped (Ctrl-Z), that
overran its expiry unawares, or whose row was broken, keeps its place but not its row. So a
waiter reads the row when it queues and waits for the place until the row's own expiry (plus
grace) at most; meanwhile it looks at the row (a read) every ``QUEUE_PATIENCE``, and tries it
once a look finds it free or takeable, its request for the place still queued in the kernel.
And whoever breaks or purges a lock through sqllocker rings the queue's *bell*: it writes
random bytes at the start of the queue file, which one thread of each process with waiters
reads whenever the file is written (inotify), and every ``BELL_INTERVAL`` besides; a change
wakes every waiter of that process to try its row (a read first). The bytes after it are the
bell for turns, then the offset of the place it last rang for: it wakes only waiters holding
their places, and the one whose place it names tries its row at once, without a read. A bell
rung for another lockstring costs those waiters a read each.

Places are open-file-description locks (Linux ``F_OFD_SETLKW``): each belongs to an open file,
not to a process, so threads and tasks of one process queue against one another too, and the
kernel gives up a place whose process died. Its wait cannot time out, so a blocked request
waits in a thread of its own; a waiter that stops waiting leaves its request to the next waiter
of its process for that lockstring, or has the place given up as soon as it is granted. Where
there are no such locks (not Linux), or no file (a database in memory), waiters back off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable

from . import forks
from .file_watch import FileWatch

if sys.platform == "linux":
    import fcntl

    _SETLK, _GETLK = fcntl.F_OFD_SETLK, fcntl.F_OFD_GETLK
    _WRLCK, _UNLCK = fcntl.F_WRLCK, fcntl.F_UNLCK
    # What F_OFD_GETLK answers first (l_type) for a byte that nobody else holds.
    _FREE = struct.pack("@h", _UNLCK)

logger = logging.getLogger("sqllocker")

SUFFIX = "-sqllocker-queue"
# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks).
_FLOCK = "@hhqqixxxx"
AVAILABLE = (
    sys.platform == "linux" and hasattr(fcntl, "F_OFD_SETLKW") and (struct.calcsize(_FLOCK) == 32)
)
# Files kept open for the next place, so that a lock cycle opens none.
KEEP_SPARE = 4
# The bell: bytes the breakers of locks rewrite at the start of the queue file, and how often a
# process whose waiters listen reads them. The bytes may share a place's offset: a place is a
# lock on a byte, which its content does not touch.
BELL_SIZE = 8
BELL_INTERVAL = 0.05
# How long a thread of the queue's with nothing left to do (one that waited for a place, the
# bell's reader) stays for more: a thread's start and end cost more CPU than a contended turn.
IDLE_SECONDS = 5.0


_pack = struct.Struct(_FLOCK).pack
# Copied for each table: cheaper than making the hash with its parameters every time.
_PLACE_HASH = hashlib.blake2b(digest_size=8, person=b"sqllocker")


def _byte(kind: int, offset: int) -> bytes:
    return _pack(kind, os.SEEK_SET, offset, 1, 0)


def offsets(table: str) -> Callable[[str], int]:
    """The byte of each lockstring's place in ``table``'s queue (``FileQueue.offset``), the
    table's part of the hash made once: a lock cycle hashes only its lockstring."""
    table_hash = _PLACE_HASH.copy()
    table_hash.update(f"{table}\0".encode())

    def offset(lockstring: str) -> int:
        place_hash = table_hash.copy()
        place_hash.update(lockstring.encode())
        return int.from_bytes(place_hash.digest(), "big") >> 2

    return offset


class FileQueue:
    """The places of one SQLite database's lockstrings (``path``: the database file)."""

    def __init__(self, path: str) -> None:
        self.path = path + SUFFIX
        self._lock = threading.Lock()
        self._spare: list[int] = []
        # Requests whose waiter stopped waiting, by offset: still queued in the kernel, for the
        # next waiter of this process to take over.
        self._unwanted: dict[int, list[PlaceRequest]] = {}
        self._pid = forks.pid
        self._closed = False
        self._listeners: set[BellListener] = set()
        self._bell_watched = False  # a thread reads the bell for this process's listeners
        self._looker: int | None = None  # see _open_looker
        self._placers = _Placers(self.thread_name)
        _QUEUES.add(self)

    @staticmethod
    def offset(table: str, lockstring: str) -> int:
        """The byte of ``lockstring``'s place: a hash, all but certain to be no one else's (a
        62-bit BLAKE2b of table and lockstring, which every version of sqllocker must agree on:
        see ``offsets``)."""
        return offsets(table)(lockstring)

    def take(self, offset: int) -> Place | None:
        """The place at ``offset`` if nobody holds it or waits for it (and the queue file can be
        opened: if not, the database itself will say why); never blocks."""
        fd = self._open()
        if fd is None:
            return None
        try:
            fcntl.fcntl(fd, _SETLK, _pack(_WRLCK, os.SEEK_SET, offset, 1, 0))
        except OSError:
            self._keep(fd)
            return None
        return Place(self, fd, offset)

    def unplaced(self, offset: int) -> Unplaced:
        """What a lock taken without its place (``offset``) leaves at its release."""
        return Unplaced(self, offset)

    def is_held(self, offset: int) -> bool:
        """Whether someone else holds the place at ``offset`` (a look, which takes nothing);
        True if the look fails, False if the queue file cannot be opened."""
        fd = self._looker if self._looker is not None else self._open_looker()
        if fd is None:
            return False
        try:
            found = fcntl.fcntl(fd, _GETLK, _pack(_WRLCK, os.SEEK_SET, offset, 1, 0))
        except OSError as error:
            logger.debug("cannot look at a place in %s (%s)", self.path, error)
            return True
        return found[:2] != _FREE

    def _open_looker(self) -> int | None:
        """The file that ``is_held`` looks through, kept open: it never takes a place (a
        forked child may share it, as a look takes nothing)."""
        fd = self._open()
        with self._lock:
            if self._looker is None and not self._closed:
                self._looker, fd = fd, None
            looker = self._looker
        if fd is not None:
            self._keep(fd)
        return looker

    def request(self, offset: int) -> PlaceRequest | None:
        """Ask for the place at ``offset``: a thread waits for it, and the request says when it
        is granted (None if the queue file cannot be opened). A request another waiter of this
        process gave up is taken over."""
        with self._lock:
            if self._pid != forks.pid:
                self._after_fork()  # the parent's requests are not this process's to take
            unwanted = self._unwanted.get(offset)
            if unwanted:
                request = unwanted.pop()
                request.wanted = True
                return request
        fd = self._open()
        if fd is None:
            return None
        request = PlaceRequest(self, fd, offset)
        self._placers.serve(request)
        return request

    def ring(self, turn: int | None = None) -> None:
        """Wake every waiter of this database to try its row: after a break or a purge, whose
        holders may still hold their places (best effort: a waiter that does not hear it finds
        out at its next look). ``turn``: the offset of a place whose row was released by a
        lock taken without it (``Unplaced``); wake only the waiters holding their places, that
        one to try its row, the others to look at theirs."""
        fd = self._open()
        if fd is None:
            return
        try:
            if turn is None:
                os.pwrite(fd, os.urandom(BELL_SIZE), 0)
            else:
                os.pwrite(fd, os.urandom(BELL_SIZE) + turn.to_bytes(BELL_SIZE, "big"), BELL_SIZE)
        except OSError as error:
            logger.debug("cannot ring the bell of %s (%s)", self.path, error)
        self._keep(fd)

    def listen(self) -> BellListener:
        """A listener to the bell for one waiter; ``close()`` it when the wait ends. It hears
        every ring that follows this call."""
        listener = BellListener(self)
        with self._lock:
            if self._pid != forks.pid:
                self._after_fork()
            self._listeners.add(listener)
            if self._bell_watched:
                return listener
            # The bell as it is now, read before this call (or another listener's, which
            # waits for the lock) returns: a ring after it is heard.
            fd = self._open()
            if fd is None:
                return listener  # nothing to read: the waiters' looks find out
            heard = _read_bell(fd)
            self._bell_watched = True
        threading.Thread(
            target=self._watch_bell, args=(fd, heard), name=f"{self.thread_name} bell", daemon=True
        ).start()
        return listener

    def _watch_bell(self, fd: int, heard: bytes | None) -> None:
        """The bell's reader: wakes this process's listeners whenever the bell changes (at
        once where the kernel says when the file is written, else at its next poll); ends once
        none has been left for ``IDLE_SECONDS`` (a process taking turns listens again within
        milliseconds), or the queue is closed."""
        watch = FileWatch.of(self.path)
        idle_since: float | None = None
        try:
            while True:
                if watch is None:
                    time.sleep(BELL_INTERVAL)
                else:
                    watch.wait(BELL_INTERVAL)
                # Read before the listeners are counted: one that came after the read also
                # comes after any ring it missed, which its own first look sees.
                now = _read_bell(fd)
                with self._lock:
                    if not self._listeners:
                        idle_since = idle_since or time.monotonic()
                        if self._closed or time.monotonic() - idle_since >= IDLE_SECONDS:
                            self._bell_watched = False
                            return
                    else:
                        idle_since = None
                    listeners = list(self._listeners)
                if now == heard:
                    continue
                broken = heard is None or now is None or now[:BELL_SIZE] != heard[:BELL_SIZE]
                # The place rung for last (rings coalesced between two reads name the last).
                turn = None if now is None else int.from_bytes(now[2 * BELL_SIZE :], "big")
                heard = now
                for listener in listeners:
                    if broken:
                        listener.ring(ours=True)
                    elif listener.turns is not None:
                        listener.ring(ours=listener.turns == turn)
        finally:
            if watch is not None:
                watch.close()
            self._keep(fd)

    @property
    def thread_name(self) -> str:
        """The name of the threads waiting for this queue's places."""
        return f"sqllocker-place {self.path}"

    def close(self) -> None:
        """Close the spare files, and end the threads that wait for nothing; places held and
        requests queued end with their own."""
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, []
            if self._looker is not None:
                spare.append(self._looker)
                self._looker = None
        if self._pid == forks.pid:  # a forked child's copies are its parent's (the locks too)
            self._placers.close()
            for fd in spare:
                os.close(fd)

    # -- files ---------------------------------------------------------------------------------

    def _open(self) -> int | None:
        if self._pid != forks.pid:
            with self._lock:
                self._after_fork()
        try:
            return self._spare.pop()  # atomic: no lock taken on every lock cycle
        except IndexError:
            pass
        try:
            # Readable and writable by whoever may write the database beside it (the umask's
            # say), so that every user of the database can queue.
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as error:
            logger.debug("cannot open %s (%s); waiting unqueued", self.path, error)
            return None

    def _keep(self, fd: int) -> None:
        """Keep ``fd`` (which holds no place) for the next place, or close it."""
        if self._pid == forks.pid and not self._closed and len(self._spare) < KEEP_SPARE:
            self._spare.append(fd)  # two threads may both pass the check: one spare more
            if not self._closed:
                return
            with contextlib.suppress(ValueError):  # closed meanwhile: close() missed it
                self._spare.remove(fd)
        os.close(fd)

    def _after_fork(self) -> None:
        if self._pid != forks.pid:  # checked again under the lock
            # A forked child starts with no files of its own: those it inherited are its
            # parent's, and its requests' threads were not forked with it.
            for fd in self._spare:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pid, self._spare, self._unwanted = forks.pid, [], {}
            self._placers = _Placers(self.thread_name)  # the parent's threads are not here
            # Nor was the bell's reader: the child's first listener starts its own.
            self._listeners, self._bell_watched = set(), False


# Every queue of this process, for ``_after_fork_in_child``.
_QUEUES: weakref.WeakSet[FileQueue] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child's queues get locks of their own before its Python runs on: a parent's
    thread may have held one at the fork, which nobody would then release (the rest of what
    the child inherited is let go of when it first uses the queue: ``_after_fork``)."""
    for queue in list(_QUEUES):
        queue._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _read_bell(fd: int) -> bytes | None:
    """The bell for breaks, then the one for turns and the offset of the place it last rang
    for (a file shorter than all three read as if padded with zeros, as a ring of the second
    leaves the first)."""
    try:
        return os.pread(fd, 3 * BELL_SIZE, 0).ljust(3 * BELL_SIZE, b"\0")
    except OSError:
        return None


class BellListener:
    """One waiter's ear for the bell: ``when_rung(wake)`` calls ``wake`` at the next ring (at
    once if one came since the last ``heard()``), ``heard()`` says whether one came. It hears
    rings for turns too once ``turns`` is set (by a waiter that holds its place: the place's
    offset); ``ours``, as of the last ``heard()``, whether a ring named that place (or was a
    break's), rather than another's."""

    def __init__(self, queue: FileQueue) -> None:
        self._queue = queue
        self._lock = threading.Lock()
        self._rung = False
        self._wake: Callable[[], None] | None = None
        self.turns: int | None = None
        self._ours = False
        self.ours = False

    def when_rung(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if not self._rung:
                self._wake = wake
                return
        wake()

    def heard(self) -> bool:
        """Whether the bell rang since this was last asked (and forget it)."""
        with self._lock:
            rung, self._rung = self._rung, False
            self.ours, self._ours = self._ours, False
            return rung

    def ring(self, ours: bool = True) -> None:
        """From the bell's reader: must not block."""
        with self._lock:
            self._rung = True
            self._ours = self._ours or ours
            wake, self._wake = self._wake, None
        if wake is not None:
            wake()

    def close(self) -> None:
        with self._queue._lock:
            self._queue._listeners.discard(self)
        self._wake = None


class Place:
    """A place held: the row is ours to try for, or ours; ``leave()`` once it is deleted.
    Dropped unleft (a lock whose release failed, then was forgotten), it closes its file, which
    gives the place up: the file would otherwise hold it for the life of the process."""

    __slots__ = ("_fd", "_offset", "_pid", "_queue")

    def __init__(self, queue: FileQueue, fd: int, offset: int) -> None:
        self._queue = queue
        self._fd: int | None = fd
        self._offset = offset
        self._pid = forks.pid

    def leave(self) -> None:
        """Give the place up (once; a forked child leaves its parent's alone)."""
        fd, self._fd = self._fd, None
        if fd is None or self._pid != forks.pid:
            return
        try:
            fcntl.fcntl(fd, _SETLK, _pack(_UNLCK, os.SEEK_SET, self._offset, 1, 0))
        except OSError as error:  # not expected; closing the file gives the place up too
            logger.warning("could not leave a lock queue's place (%s); closing its file", error)
            os.close(fd)
            return
        self._queue._keep(fd)

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # A forked child's copy is left open, as leave() leaves the place to the parent.
        if self._fd is not None and self._pid == forks.pid:
            with contextlib.suppress(OSError):
                _close(self._fd)


class Unplaced:
    """A lock taken at once, without its place (``attempts.try_once``): ``leave()``, once its
    row is deleted, rings the bell if someone holds the place, which is then the first waiter,
    waiting for a row held by someone it cannot queue behind. One look, no lock taken or left:
    a lock cycle nobody waited on pays no more for the queue."""

    __slots__ = ("_offset", "_queue")

    def __init__(self, queue: FileQueue, offset: int) -> None:
        self._queue: FileQueue | None = queue
        self._offset = offset

    def leave(self) -> None:
        queue, self._queue = self._queue, None
        if queue is not None and queue.is_held(self._offset):
            queue.ring(turn=self._offset)


class _Placers:
    """The threads that wait for places (``PlaceRequest.wait``). One whose wait has ended stays
    ``IDLE_SECONDS`` for the next request, so that a wait starts no thread while one is idle:
    a thread's start and end cost more CPU than a contended turn's statements, on the machine
    every waiter of the database shares. A waiting thread has the queue's ``thread_name``, an
    idle one that and " idle"."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._idle: list[_Slot] = []
        self._closed = False

    def serve(self, request: PlaceRequest) -> None:
        """Have a thread wait for ``request``: an idle one, else a new one."""
        with self._lock:
            if self._idle:
                slot = self._idle.pop()
                slot.request = request
                slot.handed.release()
                return
        threading.Thread(target=self._run, args=(request,), name=self._name, daemon=True).start()

    def close(self) -> None:
        """Idle threads end now (a waiting one, once its wait has)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for slot in idle:
            slot.handed.release()  # with no request: the thread ends

    def _run(self, request: PlaceRequest | None) -> None:
        slot = _Slot()
        thread = threading.current_thread()
        while request is not None:
            request.wait()
            request = None  # nor its queue kept alive by an idle thread
            thread.name = f"{self._name} idle"
            with self._lock:
                if self._closed:
                    return
                self._idle.append(slot)
            if not slot.handed.acquire(timeout=IDLE_SECONDS):
                with self._lock:
                    if slot in self._idle:
                        self._idle.remove(slot)
                        return
                # Taken by a request as the wait ran out: it is handed over next.
                slot.handed.acquire()
            request, slot.request = slot.request, None
            thread.name = self._name


class _Slot:
    """An idle placer's: ``handed`` (a lock held until then) is released once ``request`` is
    set, or with none, to end the thread."""

    __slots__ = ("handed", "request")

    def __init__(self) -> None:
        self.handed = threading.Lock()
        self.handed.acquire()
        self.request: PlaceRequest | None = None


class PlaceRequest:
    """A place asked for, waited for by a thread (``_Placers``): ``granted`` is set once the
    place is ours (``take()`` then hands it over), or the wait failed."""

    def __init__(self, queue: FileQueue, fd: int, offset: int) -> None:
        self._queue = queue
        self._fd = fd
        self._offset = offset
        self.granted = threading.Event()
        self.wanted = True
        self._got = False
        self._taken = False
        self._callback: Callable[[], None] | None = None

    def when_granted(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the waiting thread; it must not block) once granted, or now
        if it is already; it replaces any earlier callback."""
        with self._queue._lock:
            if not self.granted.is_set():
                self._callback = callback
                return
        callback()

    def take(self) -> Place | None:
        """The place, if granted (once)."""
        with self._queue._lock:
            if not self._got or self._taken:
                return None
            self._taken = True
        return Place(self._queue, self._fd, self._offset)

    def withdraw(self) -> None:
        """No longer wanted: a granted place not taken is given up at once; a request still
        queued is left for the next waiter of this process, or given up once granted."""
        with self._queue._lock:
            if not self.granted.is_set():
                self.wanted = False
                self._callback = None
                self._queue._unwanted.setdefault(self._offset, []).append(self)
                return
            place = (
                None if self._taken or not self._got else Place(self._queue, self._fd, self._offset)
            )
            self._taken = True
        if place is not None:
            place.leave()

    def wait(self) -> None:
        """The thread's work: block until the place is ours."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _byte(fcntl.F_WRLCK, self._offset))
            got = True
        except OSError as error:
            logger.warning("could not queue for a lock (%s); waiting unqueued", error)
            got = False
        with self._queue._lock:
            self._got = got
            self.granted.set()
            callback, self._callback = self._callback, None
            wanted = self.wanted
            if not wanted:
                unwanted = self._queue._unwanted.get(self._offset, [])
                if self in unwanted:
                    unwanted.remove(self)
                self._taken = True
        if not wanted:
            if got:
                Place(self._queue, self._fd, self._offset).leave()
            else:
                os.close(self._fd)
            return
        if not got:
            os.close(self._fd)
        if callback is not None:
            callback()
