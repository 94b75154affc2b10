"""asyncio: what the async front end awaits where the generated sync one blocks a thread.

The front end (the locker, the lock handle, the group, the semaphore and the release
listener) is written once, here in ``sqllocker/asyncio/``, and its sync twin in
``sqllocker/`` is generated from it (``tests/unasync.py``), importing ``sqllocker/concurrency.py``
where this code imports this module: the same names, for threads.

The lock operations themselves are sync code (``operations.LockOperations``), run in greenlets
(``run``, from ``greenlets.py``) on the AsyncEngine's ``sync_engine``: their driver calls become
awaits on the event loop, and the SQL, retries and error handling are exactly the sync front
end's.

What only asyncio has is cancellation, at any await. An acquire whose caller is cancelled runs
to its end regardless (``InFlight``), and a lock it turns out to have won is released straight
away, so no row is left behind; a release, once started, likewise runs to its end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import CoroutineType
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

try:
    from sqlalchemy.util import await_ as _await
except ImportError:  # SQLAlchemy 2.0 calls it await_only
    from sqlalchemy.util import await_only as _await

from greenlet import getcurrent

from .. import clock, deadlines
from ..decorators import refuse_deferred_work
from ..engine import create_async_locker_engine, resolve_url
from ..errors import DatabaseError, LockTypeError
from ..operations.waits import Waits
from . import alarm
from .greenlets import run as run  # sync database code, its driver calls awaited
from .tasks import spawn

T = TypeVar("T")

Event = asyncio.Event
OpLock = asyncio.Lock


class turn_within:
    """``lock``, held while the block runs (the block is told True). The threads' twin waits
    at most ``patience()`` seconds; here the caller bounds the whole release, the lock's wait
    included, where something is in flight (``AsyncLockState.release``)."""

    __slots__ = ("_lock",)

    def __init__(self, lock: asyncio.Lock, patience: Callable[[], float]) -> None:
        self._lock = lock

    # Every release enters one: no coroutine of their own.
    def __aenter__(self) -> Awaitable[bool]:
        return self._lock.acquire()  # True, once it is ours

    def __aexit__(self, *exc_info: object) -> Awaitable[None]:
        self._lock.release()
        return _DONE


class _Done:
    """An awaitable that is done at once (None), with no coroutine of its own."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return iter(())  # type: ignore[return-value]


_DONE = _Done()


class answered_by:
    """Within the block, the running task is cancelled at ``deadline`` (on ``clock.now()``), as
    by ``asyncio.timeout``, and the block then raises ``timed_out()`` instead of the
    CancelledError, unless the task was cancelled by someone else as well. What the block
    awaits is cancelled as by its caller (a statement in flight runs to its end, ``InFlight``).
    On the loop's one alarm, not a timer of its own: every acquire from a server enters one.
    (The threads' twin interrupts the thread's statements instead.) Python 3.10 does not count
    a task's cancellations: there, one by someone else in the turn the deadline passes, or while
    the block ends after it, is taken for the deadline's."""

    __slots__ = ("_alarm", "_cancelling", "_deadline", "_expired", "_task", "_timed_out")

    def __init__(self, deadline: float, timed_out: Callable[[], BaseException]) -> None:
        self._deadline = deadline
        self._timed_out = timed_out
        self._expired = False

    def __enter__(self) -> None:
        loop = asyncio.get_running_loop()
        self._task, self._cancelling = _cancel_requests()
        self._alarm = alarm.of(loop)
        self._alarm.set(self, loop.time() + (self._deadline - clock.now()))

    def expire(self) -> None:
        """The deadline has come (``alarm``)."""
        if self._task is not None and not self._task.done():
            self._expired = True
            self._task.cancel()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _tb: Any
    ) -> None:
        self._alarm.clear(self)
        if not self._expired:
            return
        uncancel = getattr(self._task, "uncancel", None)  # Python 3.11
        others = uncancel() > self._cancelling if uncancel is not None else False
        if kind is not None and issubclass(kind, asyncio.CancelledError) and not others:
            raise self._timed_out() from error


def within(
    work: Awaitable[T],
    seconds: float,
    name: str,
    timed_out: Callable[[], BaseException] | None = None,
) -> Awaitable[T]:
    """What ``work`` returns; ``asyncio.TimeoutError`` (or what ``timed_out()`` makes) once
    ``seconds`` have passed, the work
    then cancelled and left to end by itself in a task of its own: a driver may take its time
    to end a cancelled statement (psycopg sends the server a cancel request, which waits for a
    frozen server up to its connect timeout). The caller's cancellation cancels the work
    likewise, and reaches the caller at once.

    The work runs in the caller's own task, as ``InFlight`` runs it (``_Bounded``): a task of
    its own would cost every lock cycle's release a task and three turns of the event loop."""
    coroutine = work if isinstance(work, CoroutineType) else _awaited(work)
    return _Bounded(coroutine, seconds, name, timed_out)


async def _awaited(work: Awaitable[T]) -> T:
    return await work


def create_engine(
    url: str | URL | None, *, transaction_pooling: bool, max_connections: int | None
) -> AsyncEngine:
    url = resolve_url(url, asynchronous=True)
    return create_async_locker_engine(
        url, transaction_pooling=transaction_pooling, max_connections=max_connections
    )


def wrong_engine_hint(kind: str) -> str:
    return "; for an Engine use sqllocker.Locker" if kind == "Engine" else ""


def check_decorated(function: Callable[..., Any]) -> None:
    refuse_deferred_work(function)
    if not inspect.iscoroutinefunction(function):
        raise LockTypeError(
            f"{function.__qualname__} is not a coroutine function: decorate it with "
            "sqllocker.Locker.locked"
        )


def task_name() -> str | None:
    task = asyncio.current_task()
    return task.get_name() if task is not None else None


class ConnectionChanges:
    """What a ConnectionStack's callers wait on for a connection to come free, for tasks: the
    ``threading.Condition`` it is for threads, waited on in the greenlet of a lock operation.

    Its ``with`` guards nothing: tasks share one thread and run uninterrupted between awaits,
    and the stack awaits nothing while it counts. Woken first come, first served.
    """

    def __init__(self) -> None:
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None

    def wait(self, timeout: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            _await(asyncio.wait_for(waiter, timeout))
        except asyncio.TimeoutError:
            pass  # the caller looks at the time
        except BaseException:
            # Cancelled as it was woken: the next waiter gets the connection given back.
            if waiter.done() and not waiter.cancelled():
                self.notify()
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def notify(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def sleep_in_operation(seconds: float) -> None:
    """LockOperations's pause between retries, without blocking the event loop."""
    _await(asyncio.sleep(seconds))


class OneOperationAtATime:
    """What keeps the lock operations on an in-memory database's one connection apart, for
    tasks: the ``threading.RLock`` it is for threads, held by the greenlet of an operation
    across its awaits, and entered again by that operation itself. The lock of the loop it is
    entered on (an AsyncLocker moves to a new loop only once its old one has ended)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()
        self._holder: object = None
        self._depth = 0

    def __enter__(self) -> None:
        me = getcurrent()
        if self._holder is me:
            self._depth += 1
            return
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._lock = loop, asyncio.Lock()
        _await(self._lock.acquire())
        self._holder, self._depth = me, 1

    def __exit__(self, *_: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._holder = None
            self._lock.release()


# How the lock operations of an AsyncLocker wait: for tasks, in their greenlets.
WAITS = Waits(ConnectionChanges, OneOperationAtATime, sleep_in_operation)


async def sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def wait(event: asyncio.Event, timeout: float | None) -> None:
    """Until ``event`` is set or ``timeout`` (seconds) has passed."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


def woken_from_thread() -> tuple[asyncio.Event, Callable[[], None]]:
    """An event to ``wait`` for, and a function that sets it from any thread (on the running
    loop, if it still runs)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(event.set)

    return event, wake


class PooledConnection:
    """A driver connection (``driver``) checked out of the engine's pool for as long as it is
    needed (queued waits, the release listener), so that it counts toward the pool's limit;
    ``close`` closes it rather than giving it back, as its session's settings are not the
    pool's."""

    def __init__(self, fairy: Any) -> None:
        self._fairy = fairy
        self.driver: Any = fairy.driver_connection
        self.session: Any = None  # the server's id of its session, once asked

    async def close(self) -> None:
        await run(self._fairy.invalidate)


async def pooled_connection(engine: AsyncEngine, autocommit: bool = True) -> PooledConnection:
    """A PooledConnection of ``engine``'s, in autocommit (psycopg's: ``autocommit``)."""
    connection = PooledConnection(await run(engine.sync_engine.raw_connection))
    if not autocommit:
        return connection
    try:
        await connection.driver.set_autocommit(True)
    except BaseException:
        await connection.close()
        raise
    return connection


def shielded(work: Coroutine[Any, Any, T], name: str, undo: Callable[[T], None]) -> Awaitable[T]:
    """Await ``work``, which runs to its end whoever stops waiting for it (``InFlight``): if the
    caller is cancelled, ``undo`` gets what the work returns once it is done (and did not
    raise)."""
    flight: InFlight[T] = InFlight(name, undo)
    return flight.run(work)


class InFlight(Generic[T]):
    r"""Work that runs to its end whoever stops waiting for it: cancelling a caller must not cut
    a statement off halfway, when nobody would know whether the row was written.

    The caller of ``run`` drives the work in its own task, waiting on what the work waits on
    through ``_Uncancellable``: so it waits no turn of the event loop beyond the work's own
    (a task of the work's own costs one to start and one to hand its result back). If the
    caller is cancelled, it stops waiting at once and the work goes on in a task of its own;
    other callers ``wait`` on a future each, set as the work ends. ``undo`` gets what the work
    returns if its callers were all cancelled before it ended.
    """

    __slots__ = ("_driver_left", "_error", "_name", "_result", "_undo", "_waiters", "done")

    def __init__(self, name: str, undo: Callable[[T], None] | None = None) -> None:
        self._name = name
        self._undo = undo
        # Made for the first; cancelled: their callers stopped waiting.
        self._waiters: list[asyncio.Future[T]] | None = None
        self._driver_left = False  # run's caller was cancelled before the work ended
        self.done = False
        self._result: T | None = None
        self._error: BaseException | None = None

    def run(self, work: Awaitable[T]) -> Awaitable[T]:
        """Run ``work`` (once per InFlight), driven by the awaiting caller's own task: what it
        returns, or raise what it raised."""
        return _Driven(self, work if isinstance(work, CoroutineType) else work.__await__())

    async def wait(self) -> T:
        """What the work that ``run`` runs returned (or raise what it raised)."""
        if not self.done:
            waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(waiter)
            try:
                return await waiter
            except asyncio.CancelledError:
                # Cancelled as the work's result reached us: nobody else will have it. (Cancelled
                # before, the work's end undoes it.)
                if not waiter.cancelled() and waiter.exception() is None and self._undo:
                    self._undo(waiter.result())
                raise
        return self._outcome()

    def _outcome(self) -> T:
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    async def _go_on(
        self, work: Coroutine[Any, Any, T] | Generator[Any, None, T], yielded: Any
    ) -> None:
        """The work, left by its driving caller at a wait (``yielded``), to its end."""
        try:
            result = await _Resumed(work, yielded, False)
        except BaseException as error:
            self._finish(None, error)
            raise
        self._finish(result, None)

    def _finish(self, result: T | None, error: BaseException | None) -> None:
        self.done, self._result, self._error = True, result, error
        waiters, self._waiters = self._waiters, None
        if waiters is None and not self._driver_left:
            return  # run's caller, still driving the work, alone waits for it
        # run's caller still driving the work has its outcome as soon as this returns.
        told, stopped = not self._driver_left, self._driver_left
        for waiter in waiters or ():
            if waiter.done():  # cancelled: its caller stopped waiting
                stopped = True
                continue
            told = True
            if error is None:
                waiter.set_result(result)  # type: ignore[arg-type]
            elif isinstance(error, asyncio.CancelledError):
                waiter.cancel()
            else:
                waiter.set_exception(error)
        if error is None and stopped and not told and self._undo is not None:
            self._undo(result)  # type: ignore[arg-type]


def _seen_by_caller(yielded: Any) -> Any:
    """What the driving caller's task waits on for a step of the work that yielded
    ``yielded``: a future seen through ``_Uncancellable``, anything else (a bare yield) as
    it is."""
    if getattr(yielded, "_asyncio_future_blocking", None) is not None:
        return _Uncancellable(yielded)
    return yielded


class _Uncancellable:
    """A future that the work waits on, as its driving caller's task sees it: that task's
    ``cancel()`` wakes the task at once with CancelledError, without cancelling the work's own
    future. Otherwise the task waits on the work's future itself, with no turn of the event
    loop between (its callbacks are the work's future's).

    Only what ``asyncio.Task`` asks of a future it waits on (it accepts any object with
    ``_asyncio_future_blocking``). The task waiting adds one callback, kept apart from any
    others (a list made only for them): one is made and dropped every step of a lock's
    statements."""

    __slots__ = (
        "_asyncio_future_blocking",
        "_callback",
        "_context",
        "_others",
        "cancelled_by_caller",
        "driven",
        "future",
        "left",
    )

    def __init__(self, future: Any) -> None:
        self.future = future
        self._asyncio_future_blocking = True  # as a future's own __await__ sets it
        self.cancelled_by_caller = False
        # Waited on through an InFlight's driver (``_Driven``), which sees its task's
        # cancellation as ``left``: the task stops waiting, the work's bound does not see it.
        self.driven = False
        self.left = False
        self._callback: Callable[[Any], None] | None = None
        self._context: Any = None
        self._others: list[tuple[Callable[[Any], None], Callable[[Any], None], Any]] | None = None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        loop: asyncio.AbstractEventLoop = self.future.get_loop()
        return loop

    def add_done_callback(self, callback: Callable[[Any], None], *, context: Any = None) -> None:
        if self.cancelled_by_caller or self.left:  # done, whatever the work's future does
            self.get_loop().call_soon(callback, self, context=context)
            return
        if self._callback is None:
            self._callback, self._context = callback, context
            self.future.add_done_callback(self._forward, context=context)
            return

        def forward(_future: Any) -> None:
            callback(self)

        if self._others is None:
            self._others = []
        self._others.append((callback, forward, context))
        self.future.add_done_callback(forward, context=context)

    def _forward(self, _future: Any) -> None:
        callback = self._callback
        if callback is not None:
            callback(self)

    def remove_done_callback(self, callback: Callable[[Any], None]) -> int:
        removed = 0
        if self._callback is not None and self._callback == callback:
            self.future.remove_done_callback(self._forward)
            self._callback = None
            removed = 1
        if self._others:
            kept = [entry for entry in self._others if entry[0] != callback]
            for entry in self._others:
                if entry[0] == callback:
                    self.future.remove_done_callback(entry[1])
            removed += len(self._others) - len(kept)
            self._others = kept
        return removed

    def done(self) -> bool:
        return self.cancelled_by_caller or self.left or bool(self.future.done())

    def cancelled(self) -> bool:
        return self.cancelled_by_caller or self.left or bool(self.future.cancelled())

    def cancel(self, msg: Any = None) -> bool:
        """The waiting task's cancellation."""
        if self.done():
            return False
        if self.driven:
            self.left = True
        else:
            self.cancelled_by_caller = True
        self._wake()
        return True

    def expire(self) -> bool:
        """The work's deadline (``_Bounded``): the wait ends as by its caller's cancellation.
        Left by an InFlight's caller meanwhile, it wakes whoever waits on it next at once."""
        if self.left:
            self.cancelled_by_caller = True
            return True
        if self.done():
            return False
        self.cancelled_by_caller = True
        self._wake()
        return True

    def _wake(self) -> None:
        loop = self.get_loop()
        callback, self._callback = self._callback, None
        others, self._others = self._others or [], None
        if callback is not None:
            self.future.remove_done_callback(self._forward)
            loop.call_soon(callback, self, context=self._context)
        for other, forward, context in others:
            self.future.remove_done_callback(forward)
            loop.call_soon(other, self, context=context)

    def result(self) -> Any:
        if self.cancelled_by_caller or self.left:
            raise asyncio.CancelledError()
        return self.future.result()


class _Driven(Generic[T]):
    """An InFlight's work, driven by the awaiting task, every future it yields seen through
    ``_Uncancellable``; its end recorded in the InFlight. If the task is cancelled, the work
    goes on from there in a task of its own (``InFlight._go_on``), and the task gets its
    CancelledError at once."""

    __slots__ = ("_flight", "_work")

    def __init__(
        self, flight: InFlight[T], work: Coroutine[Any, Any, T] | Generator[Any, None, T]
    ) -> None:
        self._flight = flight
        self._work = work

    def __await__(self) -> Generator[Any, None, T]:
        flight, work = self._flight, self._work
        try:
            yielded = work.send(None)
        except StopIteration as finished:
            flight._finish(finished.value, None)
            return finished.value  # type: ignore[no-any-return]
        except BaseException as error:
            flight._finish(None, error)
            raise
        while True:
            through = type(yielded) is _Uncancellable
            if through:
                # A bound's view of its work's future (``within``, run to its end): waited on
                # as it is, this task's cancellation kept from the bound (``left``).
                waited = yielded
                waited.driven = True
            else:
                waited = _seen_by_caller(yielded)
            thrown: BaseException | None = None
            try:
                yield waited
            except asyncio.CancelledError:
                if through:
                    waited.driven = False
                    if waited.left or not (waited.cancelled_by_caller or waited.future.cancelled()):
                        # The caller's cancellation: the work goes on without it, its bound's
                        # wait as it was.
                        waited.left = False
                        waited._asyncio_future_blocking = True  # for the task that goes on
                        flight._driver_left = True
                        spawn(flight._go_on(work, yielded), flight._name)
                        raise
                    # Else its bound's deadline, or the work's own future cancelled: the work is
                    # told so.
                elif not (
                    type(waited) is _Uncancellable
                    and not waited.cancelled_by_caller
                    and waited.future.cancelled()
                ):
                    # The caller's cancellation: the work goes on without it.
                    flight._driver_left = True
                    spawn(flight._go_on(work, yielded), flight._name)
                    raise
                # Else the work's own future was cancelled: resumed, the work is told so.
            except BaseException as error:
                thrown = error
            try:
                yielded = work.send(None) if thrown is None else work.throw(thrown)
            except StopIteration as finished:
                flight._finish(finished.value, None)
                return finished.value  # type: ignore[no-any-return]
            except BaseException as error:
                flight._finish(None, error)
                raise


async def _resumed(work: Coroutine[Any, Any, Any], yielded: Any, cancel: bool = False) -> None:
    await _Resumed(work, yielded, cancel)


class _Resumed:
    """A coroutine already run up to a wait (what it yielded then), awaited from there: the
    task awaiting this waits on what it yielded, as the coroutine's own would have, and
    anything thrown into the task (its cancellation) is thrown into the coroutine.

    ``cancel``: that wait is cancelled first, as a task of the coroutine's own would be by
    ``cancel()`` (a task waited on may take its time to end); if there is nothing left to
    cancel (it has ended, or was cancelled already), the coroutine is thrown CancelledError at
    once, as that task's next step would be."""

    def __init__(
        self, work: Coroutine[Any, Any, Any] | Generator[Any, None, Any], yielded: Any, cancel: bool
    ) -> None:
        self._work = work
        self._yielded = yielded
        self._cancel = cancel

    def __await__(self) -> Generator[Any, Any, Any]:
        work, yielded = self._work, self._yielded
        if self._cancel and not _cancel(yielded):
            try:
                yielded = work.throw(asyncio.CancelledError())
            except StopIteration as finished:
                return finished.value
        while True:
            try:
                sent = yield yielded
            except BaseException as error:
                try:
                    yielded = work.throw(error)
                except StopIteration as finished:
                    return finished.value
            else:
                try:
                    yielded = work.send(sent)
                except StopIteration as finished:
                    return finished.value


def _cancel(waited: Any) -> bool:
    """Cancel ``waited`` if it is a future not done yet: whether it was."""
    cancel = getattr(waited, "cancel", None)
    return cancel is not None and bool(cancel())


class _Bounded(Generic[T]):
    """``within``'s work, driven by the awaiting task as ``_Driven`` drives a flight's, every
    future it yields seen through ``_Uncancellable``, for ``seconds`` at most. At the deadline
    the task stops waiting at once (``asyncio.TimeoutError``), and so it does if it is
    cancelled (CancelledError, which wins over a deadline passing in the same turn): either
    way the work goes on from there in a task of its own, cancelled (``_Resumed``). The work's
    own future cancelled is the work's to handle."""

    __slots__ = (
        "_deadline_woke",
        "_expired",
        "_name",
        "_seconds",
        "_timed_out",
        "_waited",
        "_work",
    )

    def __init__(
        self,
        work: Coroutine[Any, Any, T],
        seconds: float,
        name: str,
        timed_out: Callable[[], BaseException] | None,
    ) -> None:
        self._work = work
        self._seconds = seconds
        self._name = name
        self._timed_out = timed_out
        self._expired = False
        self._deadline_woke = False  # the deadline cancelled the wait, not the caller
        self._waited: Any = None

    def expire(self) -> None:
        """The deadline has come (``alarm``)."""
        self._expired = True
        waited = self._waited
        if isinstance(waited, _Uncancellable) and waited.expire():
            self._deadline_woke = True

    def _timeout(self) -> BaseException:
        return asyncio.TimeoutError() if self._timed_out is None else self._timed_out()

    def __await__(self) -> Generator[Any, None, T]:
        work = self._work
        requests = _cancel_requests()  # to tell the caller's cancellation from the deadline
        loop = asyncio.get_running_loop()
        timer = alarm.of(loop)
        deadline = loop.time() + max(self._seconds, 0.0)
        timer.set(self, deadline)
        made: BaseException | None = None  # the deadline's error, once made
        # Each step of the work sees the deadline (the caller's task runs it, and goes on
        # without it): its statements' waits end by then too (SQLite's busy handler, which
        # a cancellation does not end), and a contention is not tried again past it.
        bound = deadlines.waits_end_by(clock.now() + self._seconds)
        try:
            try:
                with bound:
                    yielded = work.send(None)
            except StopIteration as finished:
                return finished.value  # type: ignore[no-any-return]
            while True:
                if self._expired:  # past the deadline, and the work waits again
                    spawn(_resumed(work, yielded, cancel=True), self._name)
                    made = self._timeout()
                    raise made
                waited = self._waited = _seen_by_caller(yielded)
                thrown: BaseException | None = None
                try:
                    yield waited
                    if isinstance(waited, _Uncancellable) and waited.cancelled_by_caller:
                        # Resumed as a wait of its own is when cancelled (an InFlight driving
                        # this one is told so): as that wait's CancelledError.
                        raise asyncio.CancelledError
                except asyncio.CancelledError as cancelled:
                    if not (
                        isinstance(waited, _Uncancellable)
                        and not waited.cancelled_by_caller
                        and waited.future.cancelled()
                    ):
                        # The deadline or the caller's cancellation: the work is cancelled and
                        # ends without the caller.
                        spawn(_resumed(work, yielded, cancel=True), self._name)
                        if self._deadline_woke:
                            # Made either way: the bound's own error may record what its
                            # deadline means (a release's: the lock lost), which holds when
                            # the caller's cancellation in that turn wins.
                            made = self._timeout()
                            if not _cancelled_since(requests):
                                raise made from None
                        raise
                    thrown = cancelled  # the work's own future was cancelled: it is told so
                except BaseException as error:
                    thrown = error
                self._waited = None
                try:
                    with bound:
                        yielded = work.send(None) if thrown is None else work.throw(thrown)
                except StopIteration as finished:
                    return finished.value  # type: ignore[no-any-return]
        except DatabaseError as error:
            # The database's error, met in the deadline's turn or after it (the loop was busy):
            # the deadline's, as the sync front end judges a statement's error by the clock
            # (SQLite's busy handler, cut to the deadline, ends as the alarm rings).
            if error is made or not (self._expired or loop.time() >= deadline):
                raise
            made = self._timeout()
            raise made from error
        finally:
            timer.clear(self)


def _cancel_requests() -> tuple[asyncio.Task[Any] | None, int]:
    """The running task, and its cancellations not yet taken back (Python 3.11's
    ``cancelling()``; 0 before it)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return task, cancelling() if cancelling is not None else 0


def _cancelled_since(mark: tuple[asyncio.Task[Any] | None, int]) -> bool:
    """Whether the running task was cancelled since ``_cancel_requests`` returned ``mark``
    (in a task of the work's own, since it began: the work left its caller)."""
    task, requests = _cancel_requests()
    return requests > (mark[1] if task is mark[0] else 0)


class Background:
    """Coroutines that must not hold up their caller, each in a task of its own, kept until
    done (``close`` waits for them)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def call_soon(self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        task = asyncio.get_running_loop().create_task(function(*args), name=self._name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
