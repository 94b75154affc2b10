"""docs/fastapi.md's application, run in this process with httpx on each backend: of two
concurrent requests for one invoice, one gets 200 and the other 409; then the next gets 200."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from sqllocker import Locker  # noqa: E402
from tests.workers import async_url  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def load_example(url: str, table: str, directory: Path) -> Any:
    text = (ROOT / "docs" / "fastapi.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'AsyncLocker("postgresql://app@db/app")' in example
    example = example.replace(
        'AsyncLocker("postgresql://app@db/app")',
        f"AsyncLocker({async_url(url)!r}, table={table!r})",
    )
    path = directory / "fastapi_example.py"
    path.write_text(example)
    spec = importlib.util.spec_from_file_location("fastapi_example", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fastapi_example"] = module
    spec.loader.exec_module(module)
    return module


async def test_two_concurrent_requests_for_one_invoice_get_200_and_409(
    url: str, table_name: str, tmp_path: Path, make_locker: Callable[..., Locker]
) -> None:
    make_locker()  # creates the table
    example = load_example(url, table_name, tmp_path)
    working = asyncio.Event()
    finish = asyncio.Event()
    fences: list[int] = []

    async def send(number: int, fence: int) -> None:  # the work, held until the test says
        fences.append(fence)
        working.set()
        await finish.wait()

    example.send = send
    app = example.app
    try:
        async with example.lifespan(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                first = asyncio.create_task(client.post("/invoices/7/send"))
                await asyncio.wait_for(working.wait(), 30)
                second = await client.post("/invoices/7/send")
                other = client.post("/invoices/8/send")
                finish.set()
                first_response, other_response = await first, await other
                third = await client.post("/invoices/7/send")
    finally:
        del sys.modules["fastapi_example"]

    assert first_response.status_code == 200
    assert second.status_code == 409
    assert "invoice 7" in second.json()["detail"]
    assert other_response.status_code == 200  # another invoice is not held up
    assert third.status_code == 200  # released at the end of the first request
    assert first_response.json()["lock_id"] == fences[0]
    assert third.json()["lock_id"] > first_response.json()["lock_id"]
