"""Test helpers for the experiment trackers: an environment in which W&B and MLflow stay on this
machine (W&B offline, MLflow's file store, no telemetry), and readers of what they wrote (W&B's
offline `.wandb` file, MLflow through its client)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any


def offline_env(home: Path) -> dict[str, str]:
    """Variables under which neither tracker reaches the network or the user's home: W&B offline,
    silent, without git, code saving or error reports, its caches under `home`; MLflow without
    telemetry."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }


# variables of the caller's that would send a test's runs elsewhere
FOREIGN = (
    "WANDB_DIR",
    "WANDB_PROJECT",
    "WANDB_ENTITY",
    "WANDB_RUN_ID",
    "WANDB_RESUME",
    "WANDB_API_KEY",
    "WANDB_BASE_URL",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_RUN_ID",
)


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B `.wandb` file (its LevelDB-style log: a 7-byte header, then 32 KiB
    blocks of chunks, each with a 7-byte header: checksum, length, type full / first / middle /
    last), as `wandb_internal_pb2.Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a W&B run file"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(run_dir: Path) -> dict[str, Any]:
    """What the offline W&B runs under `<run_dir>/wandb/` hold, all of them in order (a continued
    run has one per process): {"ids", "names", "projects", "config" (the last), "history" (rows of
    {key: value}), "images" (the history's image keys and their files), "artifacts" ([(name, type,
    [file paths])]), "exit_codes"}."""
    runs = sorted((Path(run_dir) / "wandb").glob("offline-run-*"))
    assert runs, f"no offline W&B run under {run_dir}/wandb"
    out: dict[str, Any] = {
        "ids": [],
        "names": [],
        "projects": [],
        "config": {},
        "history": [],
        "images": {},
        "artifacts": [],
        "exit_codes": [],
        "dirs": runs,
    }
    for run in runs:
        (file,) = run.glob("run-*.wandb")
        for record in _finished_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["ids"].append(record.run.run_id)
                out["names"].append(record.run.display_name)
                out["projects"].append(record.run.project)
                for item in record.run.config.update:
                    out["config"][item.key] = json.loads(item.value_json)
            elif kind == "config":
                for item in record.config.update:
                    out["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                row = {}
                for item in record.history.item:
                    key = "/".join(item.nested_key) if item.nested_key else item.key
                    row[key] = json.loads(item.value_json)
                out["history"].append(row)
                for key, value in row.items():  # an image: plots/<name>/path -> media/images/...
                    if key.endswith("/path") and row.get(key[:-5] + "/_type") == "image-file":
                        out["images"][key[:-5]] = run / "files" / value
            elif kind == "artifact":
                paths = [entry.path for entry in record.artifact.manifest.contents]
                out["artifacts"].append((record.artifact.name, record.artifact.type, paths))
            elif kind == "exit":
                out["exit_codes"].append(record.exit.exit_code)
    return out


def _finished_records(file: Path, wait_s: float = 60.0) -> list[Any]:
    """The file's records once its exit record is on disk: W&B's service process writes the offline
    file, and `run.finish()` returns when the exit is handed to it, a moment before the record is
    written (seen under load). A run that never ended gives its records as they are after
    `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        records = wandb_records(file)
        if (
            any(r.WhichOneof("record_type") == "exit" for r in records)
            or time.monotonic() > deadline
        ):
            return records
        time.sleep(0.1)


def metric_rows(history: list[dict[str, Any]], columns) -> list[dict[str, Any]]:
    """The W&B history rows that hold metrics.csv columns, as {"step": N, column: value}."""
    rows = []
    for row in history:
        values = {k: v for k, v in row.items() if k in columns and k != "step"}
        if values:
            rows.append({"step": row["step"], **values})
    return rows
