"""`tools/data.py pack`: an ImageFolder tree (ImageNet's layout, or a built-in set) into WebDataset
tar shards.

Layout of the output directory (docs/data.md):
- `<split>-000000.tar`, ...: WebDataset shards: per sample `<key>.jpg` (or the source's `.png`,
  `.webp`, ...) and `<key>.cls` (the label as text), `<key>` the sample's index in the split, nine
  digits. Samples are shuffled once (`seed`) before they are cut into shards, so that every shard
  holds every class;
- `<split>.json`: the split's shard list in wids' index format (`wids.ShardListDataset` reads it as
  is), each entry with its SHA-256 and size, and the name and SHA-256 of `<split>-index.npz`: the
  label, shard, byte offset and length of every sample's image (random access without reading the
  tars);
- `dataset.json`, written last: classes in the loader's order, counts, and how the images were
  re-encoded.

Packing runs on `workers` processes with a progress bar. Every image is decoded as the loaders will
decode it; a shard holding an unreadable one is not written, the others are, and the pack then stops
naming every unreadable image (all of them in `unreadable.txt` past ten). Each finished shard is
recorded in `.pack/`: an interrupted or stopped pack, run again with the same arguments, writes only
the shards it lacks. A directory holding a finished pack is not overwritten without `overwrite`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Optional

import numpy as np
from rich.progress import Progress

from visiondist.data.index import list_image_folder
from visiondist.data.robust import name_bad
from visiondist.data.shards.shard_file import quiet_worker, write_shard
from visiondist.data.shards.store import FORMAT
from visiondist.utils.procenv import usable_cpus

# the automatic shard size's floor on a split's shards: enough for data.streams x nodes
MIN_SHARDS = 64
# ... and its floor on a shard: a small set's shards of a few images each would be mostly tar
# padding (10 KiB a file) and one request an image
MIN_SHARD_BYTES = 1e6
VERSION = 1
# every image a pack could not read, one `path<TAB>reason` a line (many of them)
UNREADABLE = "unreadable.txt"


class PackError(ValueError):
    """Bad pack input: one line naming the fix."""


@dataclass
class PackOptions:
    # source MB per shard; None: 256, or a MIN_SHARDS-th of a smaller split, at least 1
    shard_mb: Optional[float] = None
    # re-encode images whose longer side exceeds this (JPEG at `quality`)
    max_side: Optional[int] = None
    quality: int = 90
    workers: int = -1  # processes; -1: every core
    overwrite: bool = False
    seed: int = 0
    progress: bool = True


def pack_image_folder(source: Path, splits: list[str], out: Path, options: PackOptions) -> dict:
    """Pack `source/<split>/<class>/<image>` for each split into `out`; returns dataset.json's
    content."""
    out = Path(out)
    listed = {split: list_image_folder(Path(source) / split, cache=False) for split in splits}
    claim(out, options.overwrite)
    classes = listed[splits[0]][0]
    for split in splits[1:]:
        if listed[split][0] != classes:
            raise PackError(
                f"the class folders of {Path(source) / split} differ from those of "
                f"{Path(source) / splits[0]}: every split must have the same classes"
            )
    plans = check_plan(
        out, {split: plan(split, *listed[split][1:], options) for split in splits}, options
    )
    records = write_all(out, [job for split in splits for job in plans[split]], options)
    meta = describe_pack("classification", classes, source, options)
    for split in splits:
        meta["splits"][split] = write_index(out, split, plans[split], records)
    return finish(out, meta)


def describe_pack(kind: str, classes: list[str], source: Path, options: PackOptions) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "classes": classes,
        "source": str(Path(source).resolve()),
        "seed": options.seed,
        "reencoded": {"max_side": options.max_side, "quality": options.quality}
        if options.max_side
        else None,
        "splits": {},
    }


def finish(out: Path, meta: dict) -> dict:
    """dataset.json, written last: its presence says the pack is whole."""
    (out / "dataset.json.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(out / "dataset.json.tmp", out / "dataset.json")
    shutil.rmtree(out / ".pack", ignore_errors=True)
    return meta


def claim(out: Path, overwrite: bool) -> None:
    if (out / "dataset.json").is_file():
        if not overwrite:
            raise PackError(
                f"{out} already holds a finished pack: add overwrite=true to replace it, or choose "
                "another out="
            )
        splits = list(json.loads((out / "dataset.json").read_text()).get("splits", {}))
        for split in splits:  # only what a pack wrote
            for path in [
                *out.glob(f"{split}-*.tar"),
                out / f"{split}-index.npz",
                out / f"{split}.json",
                out / f"{split}-annotations.json",
            ]:
                path.unlink(missing_ok=True)
        (out / "dataset.json").unlink()
        shutil.rmtree(out / ".pack", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def plan(
    split: str,
    paths,
    labels,
    options: PackOptions,
    shuffle: bool = True,
    kind: str = "classification",
) -> list[dict]:
    """The split's shards: samples in a shuffled order (else as given), cut every `shard_mb` of
    source bytes."""
    order = (
        np.random.default_rng([options.seed, 0x5A4D]).permutation(len(paths))
        if shuffle
        else np.arange(len(paths))
    )
    sizes = [os.path.getsize(p) for p in paths]
    limit = (
        options.shard_mb * 1e6
        if options.shard_mb
        else min(256e6, max(sum(sizes) / MIN_SHARDS, MIN_SHARD_BYTES))
    )
    jobs, current, size = [], [], 0
    for key, i in enumerate(order.tolist()):
        current.append((key, paths[i], int(labels[i])))
        size += sizes[i]
        if size >= limit:
            jobs.append(current)
            current, size = [], 0
    if current:
        jobs.append(current)
    return [
        dict(
            split=split,
            name=f"{split}-{k:06d}.tar",
            samples=samples,
            max_side=options.max_side,
            quality=options.quality,
            kind=kind,
        )
        for k, samples in enumerate(jobs)
    ]


def check_plan(out: Path, plans: dict, options: PackOptions) -> dict:
    """The plan to pack by: an interrupted or stopped pack of the same listing (sources, order,
    labels) and options keeps the shards it cut then, even where files changed size since
    (unreadable ones fixed in place), so that its finished shards stay valid; another listing or
    other options restart it."""
    listing = hashlib.sha256(
        json.dumps(
            [[sample for j in plans[s] for sample in j["samples"]] for s in plans]
            + [options.max_side, options.quality, options.shard_mb],
        ).encode()
    ).hexdigest()
    state = out / ".pack"
    plan_file = state / "plan.json"
    if plan_file.is_file():
        saved = json.loads(plan_file.read_text())
        if saved.get("listing") == listing:
            return {split: _recut(jobs, saved["counts"][split]) for split, jobs in plans.items()}
    if state.exists():
        shutil.rmtree(state)
    state.mkdir()
    plan_file.write_text(
        json.dumps(
            {
                "listing": listing,
                "counts": {
                    split: [len(j["samples"]) for j in jobs] for split, jobs in plans.items()
                },
            }
        )
    )
    return plans


def _recut(jobs: list[dict], counts: list[int]) -> list[dict]:
    """`jobs`' samples, in their order, cut into shards of `counts` samples (the names follow the
    new cut)."""
    if not jobs:
        return jobs
    samples = [sample for job in jobs for sample in job["samples"]]
    bounds = np.cumsum([0, *counts]).tolist()
    template = {k: v for k, v in jobs[0].items() if k not in ("name", "samples")}
    split = template["split"]
    return [
        dict(template, name=f"{split}-{k:06d}.tar", samples=samples[a:b])
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]


def write_all(out: Path, jobs: list[dict], options: PackOptions) -> dict[str, dict]:
    """Every shard not recorded as finished, on `options.workers` processes; the records of all."""
    records = {}
    todo = []
    for job in jobs:
        record_file = out / ".pack" / f"{job['name']}.json"
        if record_file.is_file() and (out / job["name"]).is_file():
            records[job["name"]] = json.loads(record_file.read_text())
        else:
            todo.append(job)
    workers = options.workers if options.workers > 0 else usable_cpus()
    total = sum(len(j["samples"]) for j in jobs)
    kept = len(jobs) - len(todo)
    if kept:
        print(
            f"{kept} of {len(jobs)} shards were written by an earlier run of this pack: writing "
            f"the other {len(todo)}",
            flush=True,
        )
    with Progress(disable=not options.progress, transient=False) as bar:
        task = bar.add_task(
            f"packing {len(todo)} of {len(jobs)} shards" if kept else f"packing {len(jobs)} shards",
            total=total,
            completed=sum(len(j["samples"]) for j in jobs if j["name"] in records),
        )
        pool = (
            get_context("fork").Pool(min(workers, len(todo)), initializer=quiet_worker)
            if workers > 1 and len(todo) > 1
            else None
        )
        written = (pool.imap_unordered if pool else map)(
            write_shard, [(str(out), job) for job in todo]
        )
        bad = []
        try:
            for record in written:
                if record.get("bad"):
                    bad += [(path, reason, record["name"]) for path, reason in record["bad"]]
                    bar.advance(task, record["nsamples"])
                    continue
                records[record["name"]] = record
                bar.advance(task, record["nsamples"])
        except BaseException:
            if pool is not None:
                pool.terminate()
            raise
        if pool is not None:
            pool.close()
            pool.join()
    if bad:  # what training would replace or evaluation refuse; the shards without them are written
        named = name_bad([(path, reason) for path, reason, _ in bad], out / UNREADABLE)
        raise PackError(
            f"{len(bad)} of {total} images cannot be read: {named}. Fix them in place and run the "
            f"same command again: it writes only the {len({b[2] for b in bad})} shards that hold "
            "them (the finished ones are kept); removing files changes the plan, and the pack "
            "starts over"
        )
    (out / UNREADABLE).unlink(missing_ok=True)
    return records


def write_index(
    out: Path, split: str, jobs: list[dict], records: dict, extra: Optional[dict] = None
) -> dict:
    """`<split>-index.npz` and `<split>.json` (with `extra` entries); checks every sample is in
    exactly one shard. `label` holds the class (classification) or the COCO image id (detection)."""
    labels, shard, offset, length = [], [], [], []
    shardlist = []
    for k, job in enumerate(jobs):
        record = records[job["name"]]
        if (
            record["nsamples"] != len(job["samples"])
            or (out / job["name"]).stat().st_size != record["filesize"]
        ):
            raise PackError(
                f"{out / job['name']} does not hold what was written: pack again with "
                "overwrite=true"
            )
        labels += [label for _, _, label in job["samples"]]
        shard += [k] * record["nsamples"]
        offset += record["offsets"]
        length += record["sizes"]
        shardlist.append(
            dict(
                url=job["name"],
                nsamples=record["nsamples"],
                filesize=record["filesize"],
                sha256=record["sha256"],
            )
        )
    keys = [key for job in jobs for key, _, _ in job["samples"]]
    if keys != list(range(len(keys))):
        raise PackError(
            f"split {split}: the shards do not hold samples 0..{len(keys) - 1} once each"
        )
    index = out / f"{split}-index.npz"
    with open(index, "wb") as f:
        np.savez(
            f,
            label=np.asarray(labels, np.int64),
            shard=np.asarray(shard, np.int32),
            offset=np.asarray(offset, np.int64),
            length=np.asarray(length, np.int64),
        )
    entry = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": split,
        "shardlist": shardlist,
        "index": index.name,
        "index_sha256": hashlib.sha256(index.read_bytes()).hexdigest(),
        "index_size": index.stat().st_size,
        **(extra or {}),
    }
    (out / f"{split}.json").write_text(json.dumps(entry, indent=1))
    return {
        "samples": len(keys),
        "shards": len(jobs),
        "bytes": sum(r["filesize"] for r in shardlist),
    }
