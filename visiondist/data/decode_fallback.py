"""The images the loader workers decoded under `data.decode_on=device` because the device cannot
(`FallbackCount`): counted for the run's summary, each listed in `<run>/worker_decoded.txt`, and
said once in the log."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from visiondist.data.device_decode import EncodedBatch, decoder_name
from visiondist.utils.signals import RUN_DIR_ENV

log = logging.getLogger(__name__)


class FallbackCount:
    """The images the workers had to decode under `data.decode_on=device`: training's counted (the
    run's summary gives the count), each file, training's and evaluation's, listed once per rank in
    `<run>/worker_decoded.txt` (`path<TAB>why`, a line per file and rank), and one log line the
    first time there are any: their count so far and the first `NAMED` names. A training file counts
    once per time it is read, every epoch."""

    NAMED = 3

    def __init__(self) -> None:
        self.images = self.fallbacks = 0
        self.named: set[str] = set()

    def add(self, batch: EncodedBatch, device: torch.device) -> None:
        if not self.images:
            log.info(
                "data.decode_on=device: training and val JPEGs are decoded on %s by %s",
                device,
                decoder_name(device),
            )
        self.images += len(batch)
        self.fallbacks += int((batch.crops[:, 0] == 0).sum())
        self._name(getattr(batch, "decoded_by_worker", []))

    def naming(self, batches):
        """`batches` (evaluation's), each one's worker-decoded files named as training's are, none
        counted."""
        for batch in batches:
            if batch and isinstance(batch[0], EncodedBatch):
                self._name(batch[0].decoded_by_worker)
            yield batch

    def _name(self, decoded: list[tuple[str, str]]) -> None:
        new = [(name, why) for name, why in dict(decoded).items() if name not in self.named]
        if not new:
            return
        # the one line: what the device cannot decode is not an error, and rarely one file
        if not self.named:
            names = ", ".join(f"{name} ({why})" for name, why in new[: self.NAMED])
            more = f", and {len(new) - self.NAMED} more" if len(new) > self.NAMED else ""
            log.info(
                "data.decode_on=device: %d file%s so far %s decoded in the loader workers, not on "
                "the device: %s%s (%s lists every one; the run's summary counts them)",
                len(new),
                "" if len(new) == 1 else "s",
                "is" if len(new) == 1 else "are",
                names,
                more,
                WORKER_DECODED,
            )
        self.named.update(name for name, _ in new)
        listed = worker_decoded_file()
        if listed is not None:
            with listed.open("a") as f:
                f.write("".join(f"{name}\t{why}\n" for name, why in new))


WORKER_DECODED = "worker_decoded.txt"


def worker_decoded_file():
    """`<run>/worker_decoded.txt` of the run this process belongs to (None outside a run)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    return Path(run_dir) / WORKER_DECODED if run_dir else None


def count_worker_decoded(run_dir) -> int:
    """The files any rank had the workers decode (each listed once per rank that met it)."""
    path = Path(run_dir) / WORKER_DECODED
    return (
        len({line.split("\t", 1)[0] for line in path.read_text().splitlines()})
        if path.is_file()
        else 0
    )
