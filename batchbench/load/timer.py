"""Waking at a send time to within a fraction of a millisecond, without spinning: the open loop's timer.

An event loop's own timers fire up to a millisecond late: epoll's and libuv's timeouts are whole
milliseconds, which alone put the schedule lag's p99 near 1 ms at 1,000 requests/s. Waking a millisecond
early and yielding until the time comes fixes the lag but spins: at 1,000 requests/s, most of a core, and
more CPU per request than the request itself (docs/measurement.md).

On Linux a ``timerfd`` armed at an absolute CLOCK_MONOTONIC instant (the clock :func:`batchbench.core.clock.now`
reads) becomes readable when the kernel's high-resolution timer fires, within the thread's timer slack (50 µs by
default); the loop's poll returns on that readiness, not on its own rounded timeout. One fd per timer, re-armed
for each send: a ``timerfd_settime`` call, a wake-up and an 8-byte read per request.

``os.timerfd_create`` arrives in Python 3.13; batchbench supports 3.11, so the two calls go through ctypes
(written by hand for that reason only). Where there is no timerfd (not Linux, or a libc without it) the timer
falls back to the loop's own timer and the early wake.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import math
import os
import sys

from batchbench.core.clock import now

#: How early the fallback wakes before a send time, to yield to the loop (the streams' reads go on) until then.
FALLBACK_SLACK_S = 0.001

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.timerfd_settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                         ctypes.POINTER(_Itimerspec))
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class SendTimer:
    """``await timer.until(t)``: return at ``t`` (a :func:`now` reading) or just after, on the running loop.

    ``precise`` says whether a timerfd does it (else the loop's timer and a spin of at most
    :data:`FALLBACK_SLACK_S`). One waiter at a time: the open loop sends its requests in order. ``close()``
    releases the fd."""

    def __init__(self) -> None:
        self._fd = -1
        self._spec = _Itimerspec()
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if _LIBC is not None:
            fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            if fd >= 0:
                self._fd = fd

    @property
    def precise(self) -> bool:
        return self._fd >= 0

    async def until(self, deadline: float) -> None:
        delay = deadline - now()
        if delay <= 0:
            return
        if self._fd < 0:
            if delay > FALLBACK_SLACK_S:
                await asyncio.sleep(delay - FALLBACK_SLACK_S)
            while now() < deadline:
                await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None:
                self._loop.remove_reader(self._fd)
            loop.add_reader(self._fd, self._fired)
            self._loop = loop
        seconds, nanoseconds = divmod(math.ceil(deadline * 1e9), 1_000_000_000)  # never before the deadline
        self._spec.it_value.tv_sec = seconds
        self._spec.it_value.tv_nsec = nanoseconds
        assert _LIBC is not None, "a timerfd without libc"  # _fd is only ever set where libc has timerfd
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)  # the expiration count: reading it disarms readiness
        except BlockingIOError:
            return  # re-armed for a later time before this readiness was handled
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        if self._fd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SendTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
