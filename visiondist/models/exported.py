"""What an exported file is, before anything runs it: which runtime runs it (`runtime_of`), what an
ONNX graph written by tools/export.py computes (`graph_task`), and whether it fits the model config
a prediction or an evaluation runs it under (`check_runtime_file`: one line naming the fix).
`checkpoint/export/runtimes.py` runs the file."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from visiondist.config import ConfigError
from visiondist.models.registry import TASKS

# file suffix -> the runtime that runs it
RUNTIMES = {".onnx": "ONNX Runtime", ".pt2": "torch.export", ".xml": "OpenVINO"}
# the runtime -> the extra that installs it
EXTRAS = {"ONNX Runtime": "export", "OpenVINO": "openvino", "torch.export": "export"}


def runtime_of(path: Path) -> Optional[str]:
    """The runtime that runs an exported file ("ONNX Runtime", "torch.export", "OpenVINO": an IR's
    .xml), or None for weights (and for a .pt2 that is no torch.export archive)."""
    path = Path(path)
    kind = RUNTIMES.get(path.suffix.lower()) if path.is_file() else None
    if kind == "torch.export" and not _is_program(path):
        return None
    return kind


def _is_program(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(n.endswith("/archive_format") for n in archive.namelist())


def graph_task(path: Path) -> tuple[str, dict[str, Any]]:
    """What a graph written by tools/export.py (ONNX, or an OpenVINO IR with its sidecar) computes,
    from its inputs and outputs alone: ("classification", {"side": S or None, "classes": K or
    None}) or ("detection", {"input": its `input` metadata}); ValueError naming the fix for a graph
    of another form (an older one-image detector graph, someone else's)."""
    inputs, dims, out, meta = _signature(Path(path))
    if inputs == ["images"]:
        side = dims[-1] if len(dims) == 4 and dims[-1] == dims[-2] else None
        return "classification", {"side": side, "classes": out[-1] if len(out) == 2 else None}
    if inputs == ["images", "sizes"] and "input" in meta:
        return "detection", {"input": json.loads(meta["input"])}
    if inputs == ["image"]:
        raise ValueError(
            "is a one-image detector graph of an earlier export: export the run again "
            "(tools/export.py format=onnx writes batched graphs)"
        )
    raise ValueError(
        f"is a graph with inputs {', '.join(inputs)}, not one tools/export.py wrote "
        "(images, or images and sizes)"
    )


def export_record(path: Path) -> tuple[dict[str, Any], str]:
    """What tools/export.py recorded beside or inside a file, and where: the sidecar `<stem>.json`
    (safetensors' model.json, an IR's), else an ONNX graph's own metadata (each value parsed where
    it is JSON text); ({}, "") where nothing records it or it cannot be read."""
    path = Path(path)
    sidecar = path.with_suffix(".json")
    try:
        if path.is_file() and sidecar.is_file() and sidecar != path:
            return json.loads(sidecar.read_text()), sidecar.name
        if path.suffix.lower() == ".onnx" and path.is_file():
            meta = {k: _parsed(v) for k, v in _onnx_metadata(path).items()}
            return meta, f"{path.name}'s metadata"
    except (OSError, ValueError, ImportError, AttributeError):
        pass
    return {}, ""


def weights_file(path: Path) -> Path:
    """The weights a tool's `weights=<path>` names: a timm repository's model.safetensors where
    `path` is one (tools/export.py format=hf of a ViT: config.json with its `architecture`, the
    weights and their `model.json` record beside it), else `path`."""
    path = Path(path)
    config = path / "config.json"
    if not (path.is_dir() and config.is_file() and (path / "model.safetensors").is_file()):
        return path
    try:
        timm_repo = "architecture" in json.loads(config.read_text())
    except (OSError, ValueError):
        return path
    return path / "model.safetensors" if timm_repo else path


def own_record(path: Path) -> dict[str, Any]:
    """What a file of an export records of itself: an ONNX file's own metadata (a sidecar beside
    it may be a later export's), else its sidecar's (`export_record`); {} where nothing does."""
    path = Path(path)
    if path.suffix.lower() == ".onnx":
        try:
            return {k: _parsed(v) for k, v in _onnx_metadata(path).items()}
        except (OSError, ValueError, ImportError, AttributeError):
            return {}
    return export_record(path)[0]


def _onnx_proto(path: Path):
    import onnx  # noqa: PLC0415 (onnx: the export extra)

    return onnx.load(str(path), load_external_data=False)


def _onnx_metadata(path: Path) -> dict[str, str]:
    """An ONNX file's metadata_props, read without its graph's inputs (a file may have none)."""
    return {p.key: p.value for p in _onnx_proto(path).metadata_props}


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:  # a plain string (the model's name)
        return text


def recorded_model(path: Path) -> Optional[tuple[str, str]]:
    """(the model's config name, where it is recorded) as tools/export.py wrote it
    (`export_record`); None where nothing records it (another tool's file, an earlier export)."""
    record, where = export_record(path)
    name = record.get("model")
    return (name, where) if isinstance(name, str) and name else None


def _signature(path: Path) -> tuple[list[str], list, list, dict[str, str]]:
    """A graph's input names, its first input's and first output's dimensions (None where
    dynamic) and its metadata (ONNX: its metadata_props; an IR: its sidecar `<stem>.json`)."""
    if path.suffix.lower() == ".xml":
        import openvino as ov  # noqa: PLC0415 (openvino: the openvino extra)

        model = ov.Core().read_model(str(path))
        inputs = [i.get_any_name() for i in model.inputs]

        def dims(port) -> list:
            shape = port.get_partial_shape()
            return [d.get_length() if d.is_static else None for d in shape]

        sidecar = path.with_suffix(".json")
        meta = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
        meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
        return inputs, dims(model.inputs[0]), dims(model.outputs[0]), meta
    proto = _onnx_proto(path)
    first_in = proto.graph.input[0].type.tensor_type.shape.dim
    first_out = proto.graph.output[0].type.tensor_type.shape.dim
    return (
        [i.name for i in proto.graph.input],
        [d.dim_value or None for d in first_in],
        [d.dim_value or None for d in first_out],
        {p.key: p.value for p in proto.metadata_props},
    )


def check_runtime_file(model_cfg, path: Path, key: str = "model.weights") -> None:
    """An exported file fits the model config it is run under (the task, a classifier's input size
    and class count); ConfigError naming the setting that fixes it."""
    kind = runtime_of(path)
    task = TASKS[model_cfg.family]
    if kind == "torch.export":
        info = program_info(path)
        if info is None:
            raise ConfigError(
                f"{key}={path} is a torch.export program (tools/export.py format=pt2 writes "
                "such) that tools/export.py did not write (no visiondist.json inside, which says "
                "its inputs): give a file tools/export.py wrote, or weights"
            )
        if task != "classification":
            raise ConfigError(
                f"{key}={path} is a torch.export program: a classifier's, not a {task} model's"
            )
        _check_classifier(model_cfg, path, key, info.get("input_size"), info.get("num_classes"))
        return
    try:
        graph, info = graph_task(path)
    except ImportError:
        raise ConfigError(
            f"{key}={path} runs under {kind}: pip install -e '.[{EXTRAS[str(kind)]}]'"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"{key}={path} {exc}") from None
    except Exception as exc:  # onnx's parse errors
        raise ConfigError(f"{key}={path} cannot be read as a {kind} graph ({exc})") from None
    if graph != task:
        recorded = recorded_model(path)
        raise ConfigError(
            f"{key}={path} is a {graph} graph but model={model_cfg.name} is a {task} model: give "
            + (
                f"the model it was exported from, model={recorded[0]} ({recorded[1]})"
                if recorded
                else "the model it was exported from"
            )
        )
    if graph == "classification":
        _check_classifier(model_cfg, path, key, info["side"], info["classes"])


def _check_classifier(model_cfg, path: Path, key: str, side, classes) -> None:
    """A classifier file's input size and class count against the config's; ConfigError naming
    the setting that fixes a difference."""
    if side and int(side) != int(model_cfg.img_size):
        raise ConfigError(
            f"{key}={path} takes {side} px images but model.img_size={model_cfg.img_size}: "
            f"set model.img_size={side}"
        )
    if classes and int(classes) != int(model_cfg.num_classes):
        raise ConfigError(
            f"{key}={path} gives {classes} logits but model.num_classes="
            f"{model_cfg.num_classes}: set data.num_classes={classes}"
        )


def program_info(path: Path) -> Optional[dict[str, Any]]:
    """What a torch.export program written by tools/export.py says of itself (the archive's
    `visiondist.json`: classes, input size, normalisation), read without loading it; None for
    someone else's program."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(
                (n for n in archive.namelist() if n.endswith("/extra/visiondist.json")), None
            )
            return None if name is None else json.loads(archive.read(name))
    except (OSError, ValueError, zipfile.BadZipFile):
        return None


def recorded_settings(
    weights: Path, overrides: list[str], tool: str, data_needed: bool = True
) -> list[str]:
    """model=<name> where the command names no model and the file records the one it was exported
    from (`export_record`), with a ViT's recorded shape and input size (`_recorded_shape`), and, for
    a tool that reads no data (`data_needed` False: prediction), a classifier's class count, said
    in one line; else nothing."""
    if any(o.lstrip("+").startswith("model=") for o in overrides):
        return []
    record, where = export_record(weights)
    name = record.get("model")
    if not isinstance(name, str) or not name:
        return []
    settings = [f"model={name}"]
    settings += [f"{k}={v}" for k, v in _recorded_shape(record, name, overrides).items()]
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    count = record.get("num_classes") or len(record.get("classes") or [])
    if (
        not data_needed
        and _classifier(name)
        and isinstance(count, int)
        and count > 0
        and not given & {"data", "data.num_classes", "model.num_classes"}
    ):
        # the default data's count (data=shapes: 6) is not the file's; prediction reads no data
        settings.append(f"data.num_classes={count}")
    print(
        f"{tool} weights={weights}: {' '.join(settings)} as {where} records it (any of them given "
        "wins)",
        flush=True,
    )
    return settings


def _classifier(name: str) -> bool:
    """Whether model=`name` (configs/model/<name>.yaml) is a classifier."""
    path = Path(__file__).resolve().parents[2] / "configs" / "model" / f"{name}.yaml"
    if not path.is_file():
        return False
    named = OmegaConf.load(path)
    return isinstance(named, DictConfig) and named.get("family") == "vit"


# a timm ViT's constructor arguments (an export's `create`) and the model config's keys for them
_VIT_SHAPE = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")


def _recorded_shape(record: dict[str, Any], name: str, overrides: list[str]) -> dict[str, Any]:
    """A ViT export's shape (where it differs from model=`name`'s config) and input size, as its
    `record` holds them, where the command does not give them (`model.depth=2`,
    `data.img_size=32`): the file is then read as the model it holds."""
    create = record.get("create")
    path = Path(__file__).resolve().parents[2] / "configs" / "model" / f"{name}.yaml"
    if record.get("library") != "timm" or not isinstance(create, dict) or not path.is_file():
        return {}
    named = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(named, dict)  # a model config: a mapping
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    shape = {
        f"model.{k}": create[k]
        for k in _VIT_SHAPE
        if k in create and create[k] != named.get(k) and f"model.{k}" not in given
    }
    size = record.get("input_size")
    if isinstance(size, int) and "data.img_size" not in given:
        shape["data.img_size"] = size
    return shape
