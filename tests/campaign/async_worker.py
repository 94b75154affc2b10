"""An asyncio worker process: the sync worker's operations through ``sqllocker.asyncio``, and
acquires abandoned part-way (``asyncio.wait_for`` around them, the TimeoutError kept), which
must either hand back their lock or release what they won.

``python -m tests.campaign.async_worker CONFIG_JSON``
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence

from sqlalchemy.ext.asyncio import create_async_engine

from sqllocker.asyncio import AsyncLock, AsyncLocker
from sqllocker.engine import resolve_url
from tests.campaign import guarded, mutants, plan
from tests.campaign.history import History, now
from tests.campaign.sections import (
    ChaosEnd,
    WorkerConfig,
    next_operation,
    outcome,
    parse_config,
)
from tests.workers import async_url


class AsyncWorker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.rng = plan.operation_rng(config.seed, config.number, config.incarnation, 0)
        self.history = History(config.history, config.name)
        url = async_url(config.url)
        self.locker = AsyncLocker(
            url, table=config.table, expires=config.expires, grace=config.grace
        )
        self.engine = create_async_engine(resolve_url(url, asynchronous=True))
        self.decorated = self.locker.locked(
            plan.DECORATED, wait=0.5, expires=config.expires, on_busy="skip"
        )(self._decorated_body)

    async def run(self) -> None:
        self.history.record("start", incarnation=self.config.incarnation)
        chaos_end = ChaosEnd(self.config)
        chaos_end.wait()
        step = 0
        while now() < chaos_end.at():
            step += 1
            self.rng = plan.operation_rng(
                self.config.seed, self.config.number, self.config.incarnation, step
            )
            if not self.config.operations:  # none of those asked for is of this kind
                await asyncio.sleep(0.1)
                continue
            op = next_operation(self.rng, self.config.operations)
            await getattr(self, op)(op)
            await asyncio.sleep(self.rng.uniform(0, 0.05))
        for lockstring in plan.LOCKS:
            await self.acquire_and_hold("liveness", lockstring, wait=self.config.liveness_wait)
        await self.semaphore("liveness", wait=self.config.liveness_wait)
        self.history.record("done")
        await self.locker.aclose()
        await self.engine.dispose()

    # -- operations ---------------------------------------------------------------------------

    async def lock_wait(self, op: str) -> None:
        # Some wait long enough to ride out an outage longer than the expiry.
        wait = self.rng.uniform(0, 2) if self.rng.random() < 0.7 else self.rng.uniform(2, 10)
        await self.acquire_and_hold(op, self.rng.choice(plan.LOCKS), wait=wait)

    async def lock_nowait(self, op: str) -> None:
        await self.acquire_and_hold(op, self.rng.choice(plan.LOCKS), wait=0)

    async def hold_at_least(self, op: str) -> None:
        await self.acquire_and_hold(
            op, self.rng.choice(plan.LOCKS), wait=1.0, hold_at_least=self.rng.uniform(0.1, 1.0)
        )

    async def try_lock(self, op: str) -> None:
        lockstring = self.rng.choice(plan.LOCKS)
        self.history.record("invoke", op=op, ls=lockstring)
        try:
            lock = await self.locker.try_lock(lockstring, expires=self.config.expires)
        except Exception as error:
            outcome(self.history, op, error, ls=lockstring)
            return
        if lock is None:
            self.history.record("fail", op=op, ls=lockstring, error="busy")
            return
        self.history.record("ok", op=op, ls=lockstring, id=lock.lock_id)
        await self.hold(op, [lock], lock)

    async def acquire_and_hold(
        self, op: str, lockstring: str, wait: float, **options: object
    ) -> None:
        keep_alive = self.rng.random() < 0.5
        self.history.record("invoke", op=op, ls=lockstring, wait=wait, keep_alive=keep_alive)
        try:
            lock = await self.locker.lock(
                lockstring,
                wait=wait,
                expires=self.config.expires,
                keep_alive=keep_alive,
                **options,  # type: ignore[arg-type]
            )
        except Exception as error:
            outcome(self.history, op, error, ls=lockstring)
            return
        self.history.record("ok", op=op, ls=lockstring, id=lock.lock_id)
        await self.hold(op, [lock], lock)

    async def lock_all(self, op: str) -> None:
        lockstrings = self.rng.sample(plan.LOCKS, 2)
        self.history.record("invoke", op=op, ls=lockstrings)
        try:
            group = await self.locker.lock_all(
                lockstrings, wait=self.rng.uniform(0, 1.5), expires=self.config.expires
            )
        except Exception as error:
            outcome(self.history, op, error, ls=lockstrings)
            return
        members = list(group.locks)
        self.history.record(
            "ok",
            op=op,
            ls=[lock.lockstring for lock in members],
            ids=[lock.lock_id for lock in members],
            asked=lockstrings,
        )
        await self.hold(op, members, group)

    async def semaphore(self, op: str, wait: float | None = None) -> None:
        permits = self.locker.semaphore(plan.SEMAPHORE, plan.SEMAPHORE_LIMIT)
        wait = self.rng.uniform(0, 1.5) if wait is None else wait
        self.history.record("invoke", op=op, sem=plan.SEMAPHORE, wait=wait)
        try:
            permit = await permits.acquire(
                wait=wait, expires=self.config.expires, keep_alive=self.rng.random() < 0.5
            )
        except Exception as error:
            outcome(self.history, op, error, sem=plan.SEMAPHORE)
            return
        self.history.record(
            "ok", op=op, ls=permit.lockstring, id=permit.lock_id, sem=plan.SEMAPHORE
        )
        await self.hold(op, [permit], permit)

    async def cancelled(self, op: str) -> None:
        """An acquire given up part-way: a lock, a group or a permit under asyncio.wait_for."""
        kind = self.rng.choice(["lock", "lock_all", "semaphore"])
        timeout = self.rng.uniform(0.0005, 0.05)
        lockstring = self.rng.choice(plan.LOCKS)
        lockstrings = self.rng.sample(plan.LOCKS, 2)
        permits = self.locker.semaphore(plan.SEMAPHORE, plan.SEMAPHORE_LIMIT)
        expires = self.config.expires
        acquires: dict[str, Callable[[], Awaitable[object]]] = {
            "lock": lambda: self.locker.lock(lockstring, wait=1.0, expires=expires),
            "lock_all": lambda: self.locker.lock_all(lockstrings, wait=1.0, expires=expires),
            "semaphore": lambda: permits.acquire(wait=1.0, expires=expires),
        }
        acquire = acquires[kind]
        self.history.record("invoke", op=op, kind=kind, timeout=timeout)
        try:
            handle = await asyncio.wait_for(acquire(), timeout)
        except TimeoutError:
            self.history.record("fail", op=op, kind=kind, error="cancelled")
            return
        except Exception as error:
            outcome(self.history, op, error, kind=kind)
            return
        members = list(handle.locks) if kind == "lock_all" else [handle]  # type: ignore[attr-defined]
        self.history.record(
            "ok",
            op=op,
            ls=[lock.lockstring for lock in members],
            ids=[lock.lock_id for lock in members],
            **({"sem": plan.SEMAPHORE} if kind == "semaphore" else {}),
        )
        await self.hold(op, members, handle)

    async def decorator(self, op: str) -> None:
        lockstring = plan.DECORATED.format(n=0)
        self.history.record("invoke", op=op, ls=lockstring)
        try:
            ran = await self.decorated(0)
        except Exception as error:
            outcome(self.history, op, error, ls=lockstring)
            return
        if ran:
            self.history.record("ok", op=op, ls=lockstring)
        else:
            self.history.record("fail", op=op, ls=lockstring, error="skipped")

    async def _decorated_body(self, n: int) -> bool:
        lockstring = plan.DECORATED.format(n=n)
        self.history.record("deco", phase="enter", ls=lockstring)
        await asyncio.sleep(self.rng.uniform(0, 0.03))
        self.history.record("deco", phase="exit", ls=lockstring)
        return True

    async def dawdle(self, op: str) -> None:
        lockstring = self.rng.choice(plan.LOCKS)
        self.history.record("invoke", op=op, ls=lockstring)
        try:
            lock = await self.locker.lock(lockstring, wait=1.0, expires=self.config.expires)
        except Exception as error:
            outcome(self.history, op, error, ls=lockstring)
            return
        self.history.record("ok", op=op, ls=lockstring, id=lock.lock_id)
        self.observe([lock])
        until = now() + self.config.expires + self.config.grace + self.rng.uniform(0.1, 1.0)
        while now() < until:
            await asyncio.sleep(0.2)
            self.observe([lock])
        await self.extend(op, lock, [lock])
        self.observe([lock])
        await self.write(op, [lock])
        await self.release(op, lock, [lock])

    # -- what a holder does -------------------------------------------------------------------

    async def hold(self, op: str, locks: Sequence[AsyncLock], handle: object) -> None:
        self.observe(locks)
        await self.write(op, locks)
        for _ in range(self.rng.randint(0, 3)):
            await asyncio.sleep(self.rng.uniform(0, 0.1))
            self.observe(locks)
        if self.rng.random() < 0.3:
            await self.extend(op, handle, locks)
            self.observe(locks)
        await self.release(op, handle, locks)

    def observe(self, locks: Sequence[AsyncLock]) -> None:
        for lock in locks:
            at = now()
            self.history.record(
                "valid", at=at, ls=lock.lockstring, id=lock.lock_id, v=lock.is_valid()
            )

    async def write(self, op: str, locks: Sequence[AsyncLock]) -> None:
        fields = {
            "ls": [lock.lockstring for lock in locks],
            "ids": [lock.lock_id for lock in locks],
        }
        self.history.record("invoke", op="write", during=op, **fields)
        try:
            seqs = await guarded.write_async(self.engine, locks, self.config.name, op)
        except Exception as error:
            outcome(self.history, "write", error, **fields)
            return
        self.history.record("ok", op="write", seqs=seqs, **fields)

    async def extend(self, op: str, handle: object, locks: Sequence[AsyncLock]) -> None:
        ids = [lock.lock_id for lock in locks]
        self.history.record("invoke", op="extend", during=op, ids=ids)
        try:
            await handle.extend()  # type: ignore[attr-defined]
        except Exception as error:
            outcome(self.history, "extend", error, ids=ids)
            return
        self.history.record("ok", op="extend", ids=ids)

    async def release(self, op: str, handle: object, locks: Sequence[AsyncLock]) -> None:
        ids = [lock.lock_id for lock in locks]
        self.history.record("invoke", op="release", during=op, ids=ids)
        try:
            await handle.unlock()  # type: ignore[attr-defined]
        except Exception as error:
            outcome(self.history, "release", error, ids=ids)
            return
        self.history.record("ok", op="release", ids=ids)


def main(argv: list[str] | None = None) -> int:
    mutants.apply()
    config = parse_config(argv)
    asyncio.run(AsyncWorker(config).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
