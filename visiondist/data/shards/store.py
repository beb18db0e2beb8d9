"""Where shards come from: a local directory, read in place, or an `http(s)://` or `s3://` URL (S3
and S3-compatible stores through boto3: credentials and `AWS_ENDPOINT_URL` as the AWS tools take
them), each shard fetched whole into a node-local cache on first use (as MosaicML Streaming, litdata
and wids do), checked against the index's SHA-256 and then read in place like a local one.

A fetch is retried (`retries` more times, with back-off) and then ends the job with the shard's URL
and the cause: never a hang, never a sample left out. A shard whose checksum differs from the index
is refused. The cache is shared by the ranks and loader workers of a node (a lock per shard: a node
fetches a shard once) and kept under `cache_gb` by dropping the least recently used shards.
`fetched` counts the bytes this rank and its workers downloaded.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from visiondist.data.shards.fetch import get, missing, no_credentials, s3_errors

log = logging.getLogger(__name__)

REMOTE_SCHEMES = ("http://", "https://", "s3://")


class ShardError(RuntimeError):
    """A shard (or an index) that cannot be had: its URL and the cause.

    Args:
        *args: the message (one line naming the fix), as any exception's.
    """


def is_url(root: str) -> bool:
    return "://" in str(root) and not str(root).startswith("file://")


# set to data.root when a job found its server away and used the cache
SERVER_AWAY = "VISIONDIST_SHARD_SERVER_AWAY"


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "visiondist" / "shards"


class ShardStore:
    """The shards of one packed data set (`root`: a directory or a URL) as local files.

    Args:
        root: a directory, an http(s):// or an s3:// URL.
        cache_dir: where fetched shards are kept; None: ~/.cache/visiondist/shards.
        cache_gb: the cache's size bound in GB.
        retries: attempts of a failing fetch.
        timeout_s: a fetch's network timeout in seconds.
    """

    def __init__(
        self,
        root: str,
        cache_dir: Optional[str] = None,
        cache_gb: float = 100.0,
        retries: int = 3,
        timeout_s: float = 60.0,
    ):
        root = str(root)
        self.remote = is_url(root)
        if root.rstrip("/").endswith(f"/{META}"):
            raise ShardError(
                f"data.root={root} names the pack's {META}: give the folder or URL that holds it, "
                f"data.root={root.rstrip('/')[: -len(META) - 1]}"
            )
        if (
            not self.remote
            and re.fullmatch(r"[A-Za-z0-9.-]+:\d+(/.*)?", root)
            and not Path(root).exists()
        ):
            raise ShardError(
                f"data.root={root} reads as a server's address: give its URL, "
                f"data.root=http://{root}"
            )
        if self.remote and not root.startswith(REMOTE_SCHEMES):
            raise ShardError(
                f"data.root={root}: shards are read from a directory, an http(s):// or an s3:// URL"
            )
        if root.startswith("s3://"):
            try:
                import boto3  # noqa: F401,PLC0415 (the s3 extra)
            except ImportError:
                raise ShardError(
                    f"data.root={root}: reading s3:// needs boto3: pip install 'visiondist[s3]'"
                ) from None
        self.root = (
            root.rstrip("/")
            if self.remote
            else str(Path(root.removeprefix("file://")).expanduser())
        )
        digest = hashlib.sha1(self.root.encode()).hexdigest()[:16]
        self.cache = (
            Path(cache_dir).expanduser() / digest if cache_dir else default_cache() / digest
        )
        self.cache_bytes = int(cache_gb * 1e9)
        self.retries, self.timeout_s = retries, timeout_s
        self.fetched = multiprocessing.Value("q", 0)  # shared with forked loader workers
        self._open: dict[str, int] = {}

    def url(self, name: str) -> str:
        return f"{self.root}/{name}" if self.remote else str(Path(self.root) / name)

    def read_small(self, name: str) -> bytes:
        """A small file of the data set (dataset.json, a split's index), fetched each time (with the
        retries)."""
        if not self.remote:
            path = Path(self.root) / name
            if not path.is_file():
                raise ShardError(_not_packed_here(path))
            return path.read_bytes()
        cached = self.cache / f"{name}.last"
        # this job found the server away
        if cached.is_file() and os.environ.get(SERVER_AWAY) == self.root:
            return cached.read_bytes()
        try:  # with a cached copy to fall back on: one attempt, no retries
            data = self._download(self.url(name), None, retries=0 if cached.is_file() else None)[0]
        except ShardError as exc:
            if not cached.is_file():
                raise
            # said once per job: its ranks and workers inherit this
            if os.environ.get(SERVER_AWAY) != self.root:
                os.environ[SERVER_AWAY] = self.root
                log.warning(
                    "%s cannot be reached (%s): reading this node's cached copy of the data "
                    "set in %s (its index fetched on %s; every shard is checked against it)%s",
                    self.root,
                    str(exc).split(" (", 1)[-1].split(")", 1)[0],
                    self.cache,
                    time.strftime("%Y-%m-%d %H:%M", time.localtime(cached.stat().st_mtime)),
                    self._cached_share(),
                )
            return cached.read_bytes()
        self.cache.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.part")
        tmp.write_bytes(data)
        os.replace(tmp, cached)  # for a run while the server is away: the cached shards stay usable
        return data

    def _cached_share(self) -> str:
        """How much of each split this node's cache holds (": train 45 of 63 shards, ..."), with
        what a missing one does; "" where the cached dataset.json does not say."""
        try:
            splits = json.loads((self.cache / "dataset.json.last").read_text())["splits"]
            held = {
                split: len({p.name.split(".")[0] for p in self.cache.glob(f"{split}-*.tar")})
                for split in splits
            }
            counts = [f"{split} {held[split]} of {int(v['shards'])}" for split, v in splits.items()]
            short = any(held[split] < int(v["shards"]) for split, v in splits.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return ""
        return f": {', '.join(counts)} shards cached" + (
            "; a shard not cached stops the run where it is first read" if short else ""
        )

    def local(self, name: str, sha256: str, size: int) -> Path:
        """The shard as a local file: in place for a directory, else fetched into the cache (once
        per node)."""
        if not self.remote:
            return self.local_file(name, size)
        # named by its content: a data set packed again at the same address (other shards of the
        # same names and sizes) is fetched again, not read from the copies of the one before
        dest = self.cache / cached_name(name, sha256)
        if _complete(dest, size):
            os.utime(dest)  # recently used: the last to be dropped
            return dest
        self.cache.mkdir(parents=True, exist_ok=True)
        with _locked(self.cache / f"{dest.name}.lock"):
            # another rank or worker of this node may have fetched it meanwhile
            if not _complete(dest, size):
                self._make_room(size)
                tmp = dest.with_name(f"{dest.name}.{os.getpid()}.part")
                try:
                    _, digest = self._download(self.url(name), tmp)
                finally:
                    if not tmp.is_file() or tmp.stat().st_size != size:
                        tmp.unlink(missing_ok=True)
                if digest != sha256:
                    tmp.unlink(missing_ok=True)
                    raise ShardError(
                        f"{self.url(name)}: its SHA-256 {digest[:16]}... differs from the index's "
                        f"{sha256[:16]}...: refused (the shard changed after packing; pack again)"
                    )
                os.replace(tmp, dest)
                with self.fetched.get_lock():
                    self.fetched.value += size
        return dest

    def local_file(self, name: str, size: int) -> Path:
        """A file of a pack in a directory, there and of the size its index says (its content is
        not hashed: a copy cut short or a file changed in place is told by its size)."""
        path = Path(self.root) / name
        if not path.is_file():
            raise ShardError(
                f"{path}: missing, the index lists it ({size} bytes): the pack's folder was copied "
                "in part; copy the whole folder again (or pack again)"
            )
        if path.stat().st_size != size:
            raise ShardError(
                f"{path}: {path.stat().st_size} bytes, the index says {size}: a copy cut short or "
                "a file changed after packing; copy the whole folder again (or pack again)"
            )
        return path

    def read(self, name: str, sha256: str, size: int, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of a shard."""
        fd = self._open.get(name)
        if fd is None:
            fd = self._open[name] = os.open(self.local(name, sha256, size), os.O_RDONLY)
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise ShardError(
                f"{self.url(name)} ends before byte {offset + length}: the shard is damaged"
            )
        return data

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def __getstate__(self):  # no open descriptors into another process
        return {**self.__dict__, "_open": {}}

    def _download(
        self, url: str, dest: Optional[Path], retries: Optional[int] = None
    ) -> tuple[bytes, str]:
        """(content if `dest` is None, SHA-256) of `url`, written to `dest` when given; retried
        (`retries`, default the store's), then ShardError."""
        last: Exception | None = None
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            try:
                return get(url, dest, self.timeout_s)
            except (OSError, *s3_errors()) as exc:  # urllib's errors are OSErrors
                last = exc
                if no_credentials(exc):  # nothing to wait for either
                    raise ShardError(
                        f"cannot fetch {url}: {exc}: give this node S3 credentials "
                        "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                        "~/.aws/credentials, or an instance role)"
                    ) from None
                if missing(exc) and url.endswith(".tar"):  # one shard the index lists
                    raise ShardError(
                        f"cannot fetch {url}: {exc}: the data set's index lists it, the server's "
                        "copy does not hold it: copy the whole folder `tools/data.py pack` wrote"
                    ) from None
                if missing(exc):  # there is nothing to wait for
                    raise ShardError(
                        f"cannot fetch {url}: {exc}; data.root must be where `tools/data.py pack` "
                        "wrote the data set"
                    ) from None
                if attempt < retries:
                    log.warning(
                        "fetching %s failed (%s): attempt %d of %d",
                        url,
                        exc,
                        attempt + 1,
                        retries + 1,
                    )
        raise ShardError(
            f"cannot fetch {url} ({last}) after {retries + 1} attempt{'s' if retries else ''}: "
            "check that the server is up and reachable from this node (a flaky one: raise "
            "data.fetch_retries)"
        )

    def _make_room(self, size: int) -> None:
        """Drop the least recently used shards of this data set's cache until `size` more bytes
        fit."""
        stats = sorted(
            (st.st_mtime, st.st_size, p)
            for p in self.cache.glob("*")
            if p.suffix not in (".lock", ".part", ".last")
            for st in (p.stat(),)
        )
        total = sum(s for _, s, _ in stats)
        for _, s, p in stats:
            if total + size <= self.cache_bytes:
                break
            p.unlink(missing_ok=True)  # a reader holding it open keeps reading it
            total -= s


def cached_name(name: str, sha256: str) -> str:
    """A shard's file in a node's cache: `train-000007.tar` holding SHA-256 `ab12...` is
    `train-000007.ab12....tar` (16 hex digits)."""
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.{sha256[:16]}.{suffix}" if dot else f"{name}.{sha256[:16]}"


def _complete(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


@contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


META = "dataset.json"  # a pack's description, written last
FORMAT = "visiondist-shards"  # its "format"


def is_pack(folder: Path) -> bool:
    """Whether `folder` holds a finished pack: its dataset.json says so (a built-in set's marker of
    the same name does not)."""
    try:
        return json.loads((Path(folder) / META).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _not_packed_here(path: Path) -> str:
    """Why a pack's file is not where data.root says, and the fix: a pack one folder down, a split
    whose pack was cut short, or no pack at all."""
    root = path.parent
    if path.name != META:
        return (
            f"{path} does not exist, though {root / META} lists the split: its pack was cut short "
            "(run the same tools/data.py pack again; it writes what is missing)"
        )
    below = sorted(p for p in root.iterdir() if is_pack(p)) if root.is_dir() else []
    if root.is_dir() and any(root.glob("*-000000.tar")):  # shards, not the file written last
        return (
            f"{path} does not exist, though {root} holds shards: the pack was cut short, or its "
            "folder copied in part (dataset.json is written last): copy the whole folder again, or "
            "run the same tools/data.py pack again (it writes what is missing)"
        )
    if below:
        return (
            f"{path} does not exist: data.root={root} holds no pack, but {below[0]} does: "
            f"set data.root={below[0]}"
        )
    return (
        f"{path} does not exist: with data.format=shards, data.root is a directory "
        "`tools/data.py pack` wrote (pack it first, or read the tree with data.format=imagefolder "
        "for class folders, data.format=auto for detection data)"
    )
