"""A loopback HTTP server over a directory, for the shard tests (python's own server; quiet;
stoppable)."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Quiet(SimpleHTTPRequestHandler):
    # tar files served so far (a list shared by the server's handlers), with `stop_after`
    served = None

    def log_message(self, *args):  # the tests read their own output
        pass

    def do_GET(self):
        if self.served is not None and self.path.endswith(".tar"):
            self.served.append(self.path)
            # the server dies: this request and every later one get nothing
            if len(self.served) > self.stop_after:
                threading.Thread(target=_kill, args=(self.server,), daemon=True).start()
                self.close_connection = True
                return
        super().do_GET()


def _kill(server) -> None:
    server.shutdown()
    server.server_close()  # the port refuses connections, as a dead server's does


@contextmanager
def serve(directory: Path, port: int = 0, stop_after: int | None = None):
    """`http://127.0.0.1:<port>` serving `directory` while the block runs; with `stop_after`, the
    server stops for good once it has served that many shards (a server killed mid-epoch)."""
    handler = type(
        "Handler",
        (_Quiet,),
        {"served": [] if stop_after is not None else None, "stop_after": stop_after},
    )
    server = ThreadingHTTPServer(
        ("127.0.0.1", port), functools.partial(handler, directory=str(directory))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def serve_s3(directory: Path, monkeypatch, bucket: str = "shards"):
    """`s3://<bucket>/<directory name>` on moto's S3-compatible server on the loopback interface,
    holding the files of `directory`; the endpoint and test credentials in the environment (ranks a
    test starts inherit them)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for key, value in (
        ("AWS_ENDPOINT_URL", endpoint),
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        monkeypatch.setenv(key, value)
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        for path in Path(directory).iterdir():
            if path.is_file():
                client.upload_file(str(path), bucket, f"{Path(directory).name}/{path.name}")
        yield f"s3://{bucket}/{Path(directory).name}"
    finally:
        server.stop()
