"""Locations reached through fsspec: the event loop's reports of failures already reported."""

from __future__ import annotations

import asyncio
import gc
import logging

import aiohttp
import pytest

from shardstore.locations import filesystem


async def _fail_unawaited(exc: BaseException) -> None:
    async def fail() -> None:
        raise exc
    task = asyncio.get_running_loop().create_task(fail())
    await asyncio.sleep(0)  # it runs and fails; nobody asks for its result
    await asyncio.sleep(0)
    del task
    gc.collect()  # Task.__del__ hands "Task exception was never retrieved" to the loop's handler


@pytest.mark.parametrize("exc, logged", [(aiohttp.ClientConnectionResetError("Cannot write to closing transport"), False),
                                         (ValueError("a bug"), True)])
def test_a_cut_connection_is_not_reported_twice(exc: BaseException, logged: bool,
                                                caplog: pytest.LogCaptureFixture) -> None:
    fs, _ = filesystem("s3://bucket/run", {"anon": True})
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run_coroutine_threadsafe(_fail_unawaited(exc), fs.loop).result(timeout=30)
    assert ("Task exception was never retrieved" in caplog.text) is logged, caplog.text
