"""An asyncio event loop in a daemon thread, for hivemind's asynchronous P2P API.

The synchronous training loop drives hivemind through it. hivemind's `DHT` lives in a forked
process; the training process talks to the same p2pd daemon through a replica `P2P` created on
this loop. Create the DHT before starting this thread (forking a process that has threads is
unsafe).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self, name: str = "diloco-p2p-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (raises its exception, or TimeoutError)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]):
        """Start `coro` on the loop without waiting; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop (hivemind's stream readers among it), then stop it."""
        if not self.loop.is_running():
            return
        try:
            self.run(self._cancel_all(), timeout=timeout)
        except Exception:  # noqa: S110 - best effort: the loop is stopped below regardless
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)

    @staticmethod
    async def _cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
