"""Seconds of work on a device, read without making the host wait for it.

The host runs ahead of a CUDA device: a step returns once its kernels are queued, so host timestamps
around steps measure how fast the host queues work, not how fast the device does it (an fp32
ViT-B/16 logged 3.7-4.1k img/s from host time, beyond what TF32 reaches on that card). `DeviceClock`
marks intervals with CUDA events recorded on the current stream, in stream order, and reads them
later, where the host waits anyway (a log line's all-reduce). On the CPU every op is synchronous and
the host's clock is the device's.
"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """The summed seconds of the intervals between `start()` and `stop()` on `device`'s current
    stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._open = None  # the running interval's start mark
        self._unread: list = []  # (start, end) marks of stopped intervals not yet read
        self._seconds = 0.0

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @property
    def running(self) -> bool:
        return self._open is not None

    def start(self) -> None:
        self._open = self._mark()

    def stop(self) -> None:
        if self._open is not None:
            self._unread.append((self._open, self._mark()))
            self._open = None

    def seconds(self) -> float:
        """The stopped intervals' seconds. On CUDA this waits for the last one's end event: call it
        where the host waits for the device anyway, or after the next steps are queued."""
        for start, end in self._unread:
            if self.cuda:
                end.synchronize()
                self._seconds += start.elapsed_time(end) / 1e3
            else:
                self._seconds += end - start
        self._unread.clear()
        return self._seconds

    def reset(self) -> None:
        self._open, self._unread, self._seconds = None, [], 0.0
