"""SIGINT / SIGTERM during a run: the first asks the loop to stop at its next safe point (after the step under
way, or at once while it waits for a batch), with a checkpoint; a second one gets the default handling (exit at
once)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None
        self._on_stop: Callable[[], None] = lambda: None

    def install(self, on_stop: Callable[[], None]) -> None:
        """Handle the signals in the running event loop; on_stop() interrupts whatever the loop waits on."""
        self._on_stop = on_stop
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.stop, sig)

    def stop(self, sig: int) -> None:
        """What a signal does (a test calls it directly)."""
        self.received = sig
        loop = asyncio.get_running_loop()
        for s in SIGNALS:
            loop.remove_signal_handler(s)
        self._on_stop()
