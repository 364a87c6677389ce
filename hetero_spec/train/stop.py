"""A clean stop for long training runs: Ctrl-C or SIGTERM finishes the step, then saves and exports.

WHY: CPU runs take hours and are stopped by hand, by a scheduler, or by a session that ends.  Dying
mid-step loses the steps since the last checkpoint and leaves no draft, only a traceback; stopping
at the next step boundary costs one step and leaves a checkpoint to ``--resume`` from and a usable
draft.  A second Ctrl-C still interrupts at once.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType


class StopRequest:
    """While entered, SIGINT and SIGTERM set ``signal_name`` instead of killing the process.

    Only the main thread can install handlers; elsewhere it installs none and never requests a stop.
    Under DDP every rank installs its own, and the training loop makes the ranks agree each step, so
    a signal to any rank stops all of them at the same step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signal_name = ""
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return bool(self.signal_name)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: the user does not want to wait for the step
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "StopRequest":
        if self.enabled:
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
