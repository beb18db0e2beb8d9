"""One fetch of a remote file for `visiondist.data.shards.store`: an http(s):// URL through urllib
or an s3:// object through boto3 (the s3 extra), streamed in chunks into a file or memory and
hashed (SHA-256) as it comes, a short read refused; and which failures a retry cannot mend (not
found, not allowed, no credentials)."""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

CHUNK = 1 << 20


def s3_errors() -> tuple:
    try:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 (the s3 extra)
    except ImportError:
        return ()
    return BotoCoreError, ClientError


def no_credentials(exc: Exception) -> bool:
    """botocore found no credentials (or part of them) on this node: a retry finds none either."""
    return type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError")


def missing(exc: Exception) -> bool:
    """Not found or not allowed: a retry would get the same answer."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code in (401, 403, 404, 410)
    code = (
        getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        if hasattr(exc, "response")
        else ""
    )
    return code in ("NoSuchKey", "NoSuchBucket", "AccessDenied", "404", "403", "InvalidAccessKeyId")


_S3_CLIENTS: dict = {}


def _s3_object(url: str, timeout_s: float):
    """(streaming body, its length) of an s3:// object; one client per process (clients do not
    survive a fork)."""
    import boto3  # noqa: PLC0415 (the s3 extra)
    from botocore.config import Config  # noqa: PLC0415 (the s3 extra)

    key = (os.getpid(), timeout_s)
    if key not in _S3_CLIENTS:
        _S3_CLIENTS[key] = boto3.client(
            "s3",
            config=Config(
                connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1}
            ),
        )
    bucket, _, name = url.removeprefix("s3://").partition("/")
    response = _S3_CLIENTS[key].get_object(Bucket=bucket, Key=name)
    return response["Body"], response.get("ContentLength")


@contextmanager
def _opened(url: str, timeout_s: float):
    if url.startswith("s3://"):
        body, length = _s3_object(url, timeout_s)
        try:
            yield body, length
        finally:
            body.close()
    else:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            yield response, response.headers.get("Content-Length")


def get(url: str, dest: Optional[Path], timeout_s: float) -> tuple[bytes, str]:
    digest = hashlib.sha256()
    chunks: list[bytes] = []
    with _opened(url, timeout_s) as (response, expected):
        out = open(dest, "wb") if dest is not None else None
        try:
            got = 0
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                got += len(chunk)
                (out.write if out is not None else chunks.append)(chunk)
        finally:
            if out is not None:
                out.close()
    if expected is not None and got != int(expected):
        raise OSError(f"the connection ended after {got} of {expected} bytes")
    return b"".join(chunks), digest.hexdigest()
