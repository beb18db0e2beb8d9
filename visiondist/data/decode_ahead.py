"""`DecodeAhead`: the encoded batches of `data.decode_on=device` decoded one ahead of the training
step, by a thread of its own.

Decoding never runs on the training step's stream: `DecodeAhead` decodes each batch in a thread of
its own, on a CUDA stream of its own, and hands the images over with an event. nvJPEG writes its
output on a stream of its own (the hardware engine ignores stream order altogether:
torchcodec#1634), while the caching allocator hands the decoder blocks freed on the caller's stream
that queued kernels may still read (pytorch/vision#9606): decoded on the step's stream, a ViT-B/16
step's gradients came out non-finite at step 2. On a stream of its own, the decoder's blocks come
from that stream's pool; the thread waits on the host for that stream alone before each decode, so
no block of the pool is still in use, and the step's stream never waits on the host. `record_stream`
keeps a handed-over batch's block from returning to the pool before the step's kernels that read it
have run.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from contextlib import nullcontext
from typing import Iterator

import torch

from visiondist.data.device_decode import EncodedBatch

log = logging.getLogger(__name__)


class DecodeAhead:
    """The batches of `source` (a loader's iterator), each `EncodedBatch` among them decoded on
    `device` by a thread of its own, one batch ahead of the step (see the module docstring for why).
    On CUDA the thread works on a stream of its own (high priority: its short kernels slot in
    between the step's) and waits for that stream alone on the host before each decode; the step's
    stream waits on an event (`EncodedBatch.images`). On the CPU the thread decodes with
    libjpeg-turbo beside the step and nothing needs ordering. Errors of the source or of a decode
    are raised by `next`, in the order of the batches. `close()` (or the end of the source) ends the
    thread."""

    def __init__(self, source: Iterator, device: torch.device, ahead: int = 1):
        if device.type == "cuda" and device.index is None:
            # the thread's own current device is 0
            device = torch.device("cuda", torch.cuda.current_device())
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._closed = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._work, name="visiondist-decode", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        kind, item = self._queue.get()
        if kind == "batch":
            return item
        self._done = True
        self._thread.join()
        if kind == "error":
            raise item
        raise StopIteration

    def _work(self) -> None:
        try:
            if self.stream is not None:
                # the current device is the thread's own (0 by default)
                torch.cuda.set_device(self.device)
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                for batch in self.source:
                    if self._closed.is_set() or not self._put(("batch", self._decoded(batch))):
                        return
            self._put(("end", None))
        except BaseException as exc:
            self._put(("error", exc))

    def _decoded(self, batch):
        images = batch[0] if isinstance(batch, (tuple, list)) and batch else None
        if not isinstance(images, EncodedBatch):
            return batch
        # a batch object may come again (the benchmark's): each hand-over its own images
        ahead = copy.copy(images)
        event = None
        # no block of this stream's pool is still read or written by queued work
        if self.stream is not None:
            drained = torch.cuda.Event()
            drained.record(self.stream)
            # (an event's wait, unlike a stream's, is not what torch's sync-debug mode flags)
            drained.synchronize()
        decoded = ahead.decode(self.device)
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        ahead.ready = (decoded, event)
        return (ahead, *batch[1:]) if isinstance(batch, tuple) else [ahead, *batch[1:]]

    def _put(self, item) -> bool:
        """Queue `item` unless `close()` comes first (False then)."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self, timeout: float = 120.0) -> None:
        """End the thread (it may be waiting to hand over a batch, or for the source's next one) and
        drop what it decoded."""
        self._closed.set()
        self._done = True
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
        if self._thread.is_alive():
            log.warning(
                "the decoding thread did not end within %.0f s of its close: its source gave no "
                "batch",
                timeout,
            )
        self._queue = queue.Queue()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
