"""What a held lock is, sync or async: the handle a caller keeps while its row exists.

A Lock holds no connection and no transaction, only what identifies its row (``lock_id`` and
the secret ``guid``). Every later statement matches both, so a Lock whose row expired and was
taken over can never touch the new holder's row.

Besides the row, a Lock knows until when it may *act* as the holder: a validity deadline on
``clock.now()`` (a clock that counts time spent suspended), taken when the acquire (or last
extend) statement was sent, plus the expiry period, minus a safety margin. The row cannot
expire before that moment (the server starts its clock no earlier than the statement was
sent), and nobody can take it over before expiry plus grace, so a holder that stops at its
deadline has always stopped before anyone else starts.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import clock, forks
from .errors import LockError, LockLost
from .finaliser import Finaliser
from .notifications import Grant, GrantKey
from .operations import Acquired
from .schema import to_utc
from .telemetry import NO_HOLD, Hold

if TYPE_CHECKING:
    from .file_queue import Place, Unplaced

logger = logging.getLogger("sqllocker")

OnLost = Callable[[LockLost], object]

# The least a release waits for a statement of its lock's that is in flight (a renewal), even
# once the lock has expired: enough for one that is merely slow.
RELEASE_PATIENCE = 1.0

# How fast our clock may run slow against the server's: twice the 500 ppm that NTP slews a clock
# by at most, so that the margin of a day-long lock covers a day of drift, not a second.
CLOCK_DRIFT = 1e-3


# How much longer than the lock's remaining life the server may keep a guarded transaction
# whose client has fallen silent (see Lock.guard).
GUARD_SILENCE_MARGIN = 1.0


# How much earlier than the moment plus the period a row's expiry may read, from the server's
# timestamps alone: SQLite's clock reads whole milliseconds (its ``now`` is up to one behind),
# and its timestamps are rounded to the millisecond (half of one more). The other backends'
# are in microseconds.
TIMESTAMP_SLACK = 0.002


def safety_margin(ttl: float) -> float:
    """How long before the row's expiry a holder stops trusting its lock: a second plus the
    drift our clock may gather over the expiry period, never more than a tenth of it, and
    the slack of the server's timestamps (a lock of a few milliseconds is valid for less)."""
    return min(ttl / 10, 1.0 + ttl * CLOCK_DRIFT) + TIMESTAMP_SLACK


def signed_grant(grant: Grant, key: GrantKey, ttl: float) -> Acquired | None:
    """The row a release's grant names, believed without reading it back: its notification is
    signed with ``key``, which only the release trigger (running with the table owner's rights)
    can read, and says when our ticket was taken and the row's times. None if it is not so
    signed (a forgery, a grant to a ticket of another key), or if the lock it grants would be
    out of time already (then the row is read back, as an unsigned grant is: ``claim_grant``).

    The lock's validity counts from a start no later than the row's creation, as an acquire's
    counts from before its statement was sent. By the server's clock the row was created
    ``created - joined`` seconds after our ticket was taken, and the ticket was taken after
    ``key.since`` (before the first join with the key was sent). So on our clock the row was
    created no earlier than ``key.since`` plus those seconds, counted at ``1 - CLOCK_DRIFT``
    should the server's clock run fast against ours; and no later than now, as its
    notification comes after it: capped at now, a server clock stepped forward between the
    join and the grant moves the start no later than the moment we heard. Both times are the
    server's ``clock_timestamp()``, when the statement ran: ``now()`` is when its transaction
    began, for a release maybe long before its DELETE."""
    signed = grant.signed
    if signed is None or not key.signed(signed):
        return None
    now = clock.now()
    waited = max(0.0, (signed.created - signed.joined).total_seconds())
    start = min(key.since + waited * (1 - CLOCK_DRIFT), now)
    # A row given less than ttl (never, by our own trigger): its deadline comes as much sooner.
    start -= max(0.0, ttl - (signed.expires - signed.created).total_seconds())
    if start + ttl - safety_margin(ttl) <= now:
        return None
    acquired = Acquired(grant.lock_id, signed.created, signed.expires)
    acquired.sent_at = start
    return acquired


class Holding:
    """What the sync and async lock states share: one acquisition's identity, whether it is
    held, whether it is known lost, its validity deadline, and the errors that describe it."""

    # What it records (sqllocker.telemetry): set by the acquisition when something records.
    telemetry: Hold = NO_HOLD

    def __init__(
        self,
        lockstring: str,
        lock_id: int,
        guid: str,
        ttl: float,
        sent_at: float,
        on_lost: OnLost | None,
    ) -> None:
        self.lockstring = lockstring
        self.lock_id = lock_id
        self.guid = guid
        self.ttl = ttl
        self.pid = forks.pid
        self.held = True
        self.lost: LockLost | None = None
        self._on_lost = on_lost
        # The handle that keeps ``on_lost`` once there is one (``held_by``), weakly.
        self._handle: weakref.ref[LockHandle[Any]] | None = None
        # Kept alive (``keep_alive()``): its on_lost is owed once for a loss, whoever meets it
        # first, the keep-alive or the holder's own release.
        self.kept_alive = False
        # Seconds from the row's creation that a release keeps it for (see Locker.lock).
        self.hold_at_least: float | None = None
        self.valid_until = sent_at + ttl - safety_margin(ttl)
        # A release has begun: its DELETE is on its way, or failed after it may have been sent
        # (its answer lost, an interrupt), and may reach the server at any moment, so the lock
        # is valid no more, though held until the release (or a retry) deletes the row.
        self.release_unsure = False
        # The shortest period of an extend of this lock whose fate is unknown (it failed, or
        # was cut short, after it may have been sent): it may yet reach the server, after an
        # extend that succeeded, and end the row that period after it lands. No deadline
        # counts on a longer period from then on. (None: there is no such extend.)
        self.unsure_ttl: float | None = None
        self._lost_lock = threading.Lock()
        # Our place in the lockstring's queue in the kernel (SQLite: see file_queue), kept
        # while the row is ours, so that the next waiter wakes the moment it is not; or, for
        # a lock taken at once without it, what rings for a waiter that came meanwhile.
        self.place: Place | Unplaced | None = None

    @property
    def on_lost(self) -> OnLost | None:
        """What to call when the lock is found lost: kept by its handle (``held_by``); None
        once the handle is gone (its finaliser then releases the row)."""
        if self._handle is None:
            return self._on_lost
        handle = self._handle()
        return None if handle is None else handle._on_lost

    @on_lost.setter
    def on_lost(self, on_lost: OnLost | None) -> None:
        handle = None if self._handle is None else self._handle()
        if handle is not None:
            handle._on_lost = on_lost
        else:
            self._on_lost = on_lost

    def held_by(self, handle: LockHandle[Any]) -> None:
        """``handle`` keeps ``on_lost`` from now on, and this state only a weak reference to
        it: the keep-alive and the finaliser hold the state, and an ``on_lost`` that refers to
        its own lock (a closure over it) would keep a dropped lock from ever being collected,
        released and no longer renewed."""
        previous = None if self._handle is None else self._handle()
        # A second handle over the same row (a writer's, over its token's) takes it over.
        handle._on_lost = self._on_lost if previous is None else previous._on_lost
        self._on_lost = None
        self._handle = weakref.ref(handle)

    def stop_renewing(self) -> None:
        """Renew the row no more, kept alive or not: it expires, or goes at the release
        (another row of its lock was lost: ``OnLostOnce``)."""
        raise NotImplementedError

    def leave_place(self) -> None:
        """Let the next waiter in the kernel's queue try for the row (once it is not ours)."""
        place, self.place = self.place, None
        if place is not None:
            place.leave()

    def is_valid(self) -> bool:
        """Held, not known lost, no release begun, before its deadline, and by this process:
        a forked child shares the handle, not the lock."""
        return (
            self.held
            and self.lost is None
            and not self.release_unsure
            and clock.now() < self.valid_until
            and self.pid == forks.pid
        )

    def renewal_by(self, fraction: float) -> float:
        """When a renewal every ``fraction`` of the period is due by the deadline: that much of
        the period after the last acquire or extend was sent (a margin earlier)."""
        return self.valid_until - self.ttl * (1 - fraction)

    def first_renewal(self, fraction: float) -> float:
        """When a lock kept alive from now is first renewed: ``fraction`` of its period from
        now, or sooner, by its deadline (kept alive late in its life, it would run out first)."""
        return min(clock.now() + self.ttl * fraction, self.renewal_by(fraction))

    def renewing(self, sent_at: float, ttl: float) -> None:
        """An extend to ``ttl`` is sent (or about to be) at ``sent_at``: once it reaches the
        server, the row expires ``ttl`` after it, which may be sooner than the deadline now
        (a shorter ttl), whether or not its answer ever comes."""
        self.valid_until = min(self.valid_until, sent_at + ttl - safety_margin(ttl))

    def renewal_unsure(self, ttl: float) -> None:
        """An extend to ``ttl`` failed or was cut short, after it may have been sent."""
        self.unsure_ttl = ttl if self.unsure_ttl is None else min(self.unsure_ttl, ttl)

    def renewed(self, sent_at: float, ttl: float) -> None:
        """An extend to ``ttl`` sent at ``sent_at`` succeeded: the deadline moves on from then,
        by no more than an extend of unknown fate may leave the row (``unsure_ttl``), which
        becomes the lock's period. A release of unknown fate stays so: its DELETE may land
        after this extend."""
        if self.unsure_ttl is not None and self.unsure_ttl < ttl:
            ttl = self.unsure_ttl
        self.ttl = ttl
        self.valid_until = sent_at + ttl - safety_margin(ttl)

    def check_extendable(self) -> None:
        """Raise LockLost if the lock was released or is known lost."""
        if not self.held:
            raise LockLost(
                f"lock {self.lockstring!r} (id {self.lock_id}) is not held: it was released",
                self.lockstring,
                self.lock_id,
            )
        if self.lost is not None:
            raise self.lost

    def check_valid(self) -> None:
        """Raise LockLost unless :meth:`is_valid`."""
        if self.is_valid():
            return
        if self.lost is not None:
            raise self.lost
        reason = (
            f"was acquired by process {self.pid}, which process {forks.pid} was forked from: "
            "only that process holds it"
            if self.pid != forks.pid
            else "was released"
            if not self.held
            else "may be released: its release is under way, or failed after its DELETE may "
            "have run"
            if self.release_unsure
            else "passed its deadline without renewal"
        )
        raise LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) {reason}; another process may hold "
            "it now",
            self.lockstring,
            self.lock_id,
        )

    def deadline_passed(self) -> LockLost:
        """The error of a kept-alive lock whose renewals did not succeed before its deadline."""
        return LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) could not be renewed before its "
            "deadline; it must be treated as lost (another process may take it over once it "
            "expires)",
            self.lockstring,
            self.lock_id,
        )

    def no_longer_renewed(self) -> LockLost:
        """The error of a kept-alive lock whose Locker was closed while it was held."""
        return LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) is no longer kept alive: its locker "
            "was closed; it must be treated as lost (another process may take it over once it "
            "expires)",
            self.lockstring,
            self.lock_id,
        )

    def guard_silence_limit(self) -> float:
        """How long the server may keep a guarded transaction whose client is silent: the
        row's remaining life as we know it (from when the last acquire or extend was sent),
        plus GUARD_SILENCE_MARGIN."""
        remaining = self.valid_until + safety_margin(self.ttl) - clock.now()
        return max(remaining, 0.0) + GUARD_SILENCE_MARGIN

    def guard_failed(self, proven: bool) -> None:
        """After a guard statement: raise LockLost (marking the lock lost) unless it proved the
        row ours and the lock is still held."""
        if proven and self.held:
            return
        lost = LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) is no longer ours (expired, taken "
            "over, purged or released); roll this transaction back",
            self.lockstring,
            self.lock_id,
        )
        if self.held:
            self.mark_lost(lost)
        raise lost

    def release_patience(self) -> float:
        """How long a release waits for a statement of its lock's that is in flight (a renewal
        stuck on a frozen server or pooler, whose driver may wait a minute, or for ever): until
        the row expires, as the holder reckons it (the deadline's margin added back), but at
        least ``RELEASE_PATIENCE``."""
        expires_at = self.valid_until + safety_margin(self.ttl)
        return max(expires_at - clock.now(), RELEASE_PATIENCE)

    def release_gave_up(self) -> LockLost:
        """The release waited its ``release_patience`` in vain for a statement in flight: the
        lock has expired unconfirmed, so it is no longer held, and is lost (on_lost once)."""
        lost = LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) could not be released before it "
            "expired: a statement on it (a renewal) was still unanswered (the database, a "
            "pooler or the network may be frozen); it is no longer ours, and another process "
            "may take it over",
            self.lockstring,
            self.lock_id,
        )
        self.held = False
        self.mark_lost(lost)
        self.leave_place()
        return lost

    def outlived(self, action: str) -> LockLost:
        """An extend got no answer (or no turn behind a renewal in flight) within its
        ``release_patience``: the row has expired unconfirmed, as the holder reckons it, so the
        lock is lost (on_lost once); it stays held, for unlock() to delete whatever is left."""
        lost = LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) could not be {action} before it "
            "expired: the database did not answer in time (it, a pooler or the network may be "
            "frozen); it must be treated as lost, and another process may take it over",
            self.lockstring,
            self.lock_id,
        )
        self.mark_lost(lost)
        return self.lost or lost

    def released_lost(self, lost: LockLost) -> None:
        """The release found the row no longer ours: the lock is neither held nor kept alive
        any more. A kept-alive lock whose keep-alive had not yet seen the loss is marked lost
        here, so that its on_lost is called (once: ``mark_lost``)."""
        self.held = False
        if self.kept_alive:
            self.mark_lost(lost)
        self.leave_place()

    def mark_lost(self, lost: LockLost) -> bool:
        """Record that the lock is lost; call on_lost the first time. True if this was the first."""
        with self._lost_lock:
            if self.lost is not None:
                return False
            self.lost = lost
        self.telemetry.lost()
        self.leave_place()
        logger.warning("%s", lost)
        if self.on_lost is not None and self.pid == forks.pid:
            try:
                self._call_on_lost(self.on_lost, lost)
            except Exception:
                logger.exception("on_lost callback for lock %r raised", self.lockstring)
        return True

    def _call_on_lost(self, on_lost: OnLost, lost: LockLost) -> None:
        on_lost(lost)


class OnLostOnce:
    """One ``on_lost`` for the ``rows`` of one lock (a writer's claim and its token, a group's
    members): called for the first of them found lost, not again for the others (an async
    one's awaitable is returned, as the callback's own would be), whose renewals stop then:
    the lock is lost whole, and its other rows, renewed on, would keep their names held for as
    long as its handle lives. They expire, or go at the release."""

    def __init__(self, on_lost: OnLost | None, rows: Iterable[Holding] = ()) -> None:
        self._on_lost = on_lost
        self.rows = list(rows)
        self._called = False
        self._calling = threading.Lock()

    def __call__(self, lost: LockLost) -> object:
        with self._calling:
            if self._called:
                return None
            self._called = True
        for row in self.rows:
            if row.lost is None:  # not the one lost, whose renewals have ended (in its task)
                row.stop_renewing()
        return None if self._on_lost is None else self._on_lost(lost)


HoldingT = TypeVar("HoldingT", bound=Holding)


def _utc(value: object) -> datetime:
    """A NOT NULL timestamp column's value, as the driver read it or already converted, as an
    aware UTC datetime."""
    if isinstance(value, datetime) and value.tzinfo is timezone.utc:
        return value
    instant = to_utc(value)
    if instant is None:
        raise TypeError("a lock row's timestamp read as NULL")
    return instant


class LockHandle(Generic[HoldingT]):
    """What a caller holds, sync or async: the row's identity and times, and the local checks
    that need no round trip. Dropping a held handle runs ``release_abandoned`` on its state."""

    def __init__(
        self,
        state: HoldingT,
        release_abandoned: Callable[[HoldingT], None],
        *,
        created: object,
        expires: object,
        locked_by: dict[str, Any],
    ) -> None:
        self._state = state
        self.lockstring = state.lockstring
        self.lock_id = state.lock_id
        self.guid = state.guid
        # As the driver read them, or datetimes: converted on first read (see ``created``).
        self._created = created
        self._expires = expires
        self.locked_by = locked_by
        self._on_lost: OnLost | None = None  # the state's, from here (``Holding.held_by``)
        state.held_by(self)
        self._finalizer = Finaliser(self, release_abandoned, state)

    def __copy__(self) -> LockHandle[HoldingT]:
        """Refused, as pickling is: a copy would share the handle's finaliser, and dropping
        the original would release the row under the copy."""
        raise TypeError(f"a lock cannot be copied ({self.lockstring!r}): keep its one handle")

    @property
    def created(self) -> datetime:
        """When the row was inserted, by the server's clock (aware, UTC).

        The acquire hands over the driver's value (SQLite's text, say); it is read into a
        datetime here, once, as most holders never look (see ``Statements._returned``).
        """
        self._created = created = _utc(self._created)
        return created

    @property
    def expires(self) -> datetime:
        """When the row expires, by the server's clock (aware, UTC), as of the acquire or the
        last extend."""
        self._expires = expires = _utc(self._expires)
        return expires

    @expires.setter
    def expires(self, value: datetime) -> None:
        self._expires = value

    @property
    def ttl(self) -> float:
        """The expiry period: extend() and keep-alive renew by this many seconds."""
        return self._state.ttl

    @property
    def is_locked(self) -> bool:
        """True until unlock(), or until the lock is found to be lost; never in a child forked
        from the process that acquired it, which does not hold it."""
        state = self._state
        return state.held and state.lost is None and state.pid == forks.pid

    def is_valid(self) -> bool:
        """Whether the holder may still act: held, not known lost, and before its deadline.

        Checked locally, without a round trip: the deadline is the moment the last successful
        acquire or extend was *sent* plus the expiry period, less a safety margin.
        """
        return self._state.is_valid()

    def check(self) -> None:
        """Raise LockLost unless :meth:`is_valid`; call it before each step of long work."""
        self._state.check_valid()

    def _refuse_in_forked_child(self, action: str) -> None:
        """A forked child shares its parent's lock handles but not its lock: releasing or
        renewing the row would pull it from under the parent, which still acts on it."""
        if self._state.pid != forks.pid:
            raise LockError(
                f"cannot {action} lock {self.lockstring!r} (id {self.lock_id}) in process "
                f"{forks.pid}: it was acquired by process {self._state.pid}, which this one was "
                "forked from, and only that process may release or extend it",
                self.lockstring,
            )

    def _unlocked_by_caller(self) -> bool:
        """Whether the caller released the lock with unlock() (then leaving a ``with`` block
        is quiet, as a second unlock() is)."""
        return not self._state.held and self._state.lost is None

    def _lapsed(self) -> LockLost | None:
        """At the end of a ``with`` block: the LockLost to report if the lock was lost (or
        lapsed) while the body ran, even if nobody took the row over meanwhile."""
        try:
            self.check()
        except LockLost as error:
            return error
        return None

    def _release_failed_at_exit(
        self, error: Exception, lost: LockLost | None, body_error: BaseException | None
    ) -> LockLost | None:
        """The release at the end of a ``with`` block raised ``error``: the LockLost to report,
        or ``error`` itself re-raised, unless the body failed: its exception must reach the
        caller whatever happens here."""
        if isinstance(error, LockLost):
            return error
        if body_error is None:
            raise error
        logger.error(
            "could not release lock %r (id %d) after the body raised; it will expire: %s",
            self.lockstring,
            self.lock_id,
            error,
            exc_info=error,
        )
        return lost

    def __repr__(self) -> str:
        state = "held" if self.is_locked else "released"
        return (
            f"<{type(self).__name__} {self.lockstring!r} id={self.lock_id} {state} "
            f"expires={self.expires.isoformat(timespec='seconds')}>"
        )


HandleT = TypeVar("HandleT", bound=LockHandle[Any])


class GroupBase(Generic[HandleT]):
    """What the sync and async groups share: the member locks, in canonical order."""

    def __init__(self, locks: Sequence[HandleT]) -> None:
        self.locks = list(locks)

    def __iter__(self) -> Iterator[HandleT]:
        return iter(self.locks)

    def __len__(self) -> int:
        return len(self.locks)

    def is_valid(self) -> bool:
        """Whether every member may still be acted on (see ``Lock.is_valid``)."""
        return all(lock.is_valid() for lock in self.locks)

    def check(self) -> None:
        """Raise LockLost unless every member is valid."""
        for lock in self.locks:
            lock.check()

    @staticmethod
    def _first_error(errors: list[BaseException]) -> None:
        """Raise the first of the errors met releasing the members (each was tried)."""
        if errors:
            lost = [error for error in errors if isinstance(error, LockLost)]
            raise (lost or errors)[0]

    def __repr__(self) -> str:
        names = ", ".join(repr(lock.lockstring) for lock in self.locks)
        return f"<{type(self).__name__} {names}>"
