"""Stopping every rank after the same step when any of them is asked to stop (SIGTERM, SIGINT).

While training, the signal only raises a flag. After each step the ranks take the largest of their
flags with one small allreduce, so all of them see the request after the same step, even when the
signal reached them at different moments (or reached only one of them, as when lms-launch signals
the ranks on its own host and others run elsewhere). They then save a checkpoint together and leave,
and none is left waiting in a collective for a rank that has gone. Before training the signals keep
their default effect: the process ends at once (the worker makes that true of SIGINT too, which
Python would otherwise turn into a KeyboardInterrupt traceback).

The allreduce after step k runs in a thread while step k+1 computes, and its answer is read after
step k+1: the ranks stop one step later than they could, and the training loop never waits for the
agreement (run synchronously it cost 2-20 ms a step with two Gloo ranks on a loaded 2-core machine).
"""
from __future__ import annotations

import signal
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The flag, the handlers that raise it, and the collective that turns it into a decision."""

    def __init__(self, size: int):
        self.size = size
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._agree: Callable[[int], int] | None = None
        self._pending: _Round | None = None

    def _raise_flag(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> "StopRequest":
        """From now on SIGTERM and SIGINT raise the flag instead of ending the process."""
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._raise_flag)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def agreed(self) -> bool:
        """Collective (every rank calls it after every step): True when any rank was asked to stop,
        as of the previous call. The same on every rank after the same step."""
        local = 0 if self.signum is None else self.signum
        if self.size == 1:
            return bool(local)
        if self._agree is None:
            from launcher.rank.collectives import make_max_across_ranks

            self._agree = make_max_across_ranks()
        # The largest signal number wins, so every rank also agrees on which signal it was.
        agreed = self._pending.result() if self._pending is not None else 0
        self._pending = _Round(self._agree, local)
        if agreed and self.signum is None:
            self.signum = agreed
        return bool(agreed)

    def close(self) -> None:
        """Waits for the agreement still running (every rank started it, so it completes). Call it
        where every rank leaves the loop normally; after an error a peer may never join it."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_status(self) -> int:
        """128 + the signal number, as a shell reports a process ended by that signal."""
        return 128 + (self.signum or 0)


class _Round:
    """One agreement running in a daemon thread (a daemon, so a rank that ends with an error is not
    held at exit by an allreduce whose peers are gone)."""

    def __init__(self, agree: Callable[[int], int], value: int):
        self._value: int | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(agree, value), name="lms-launch-stop", daemon=True)
        self._thread.start()

    def _run(self, agree: Callable[[int], int], value: int) -> None:
        try:
            self._value = agree(value)
        except BaseException as err:  # handed to the training loop, which raises it
            self._error = err

    def result(self) -> int:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

