"""tools/export.py's job and `visiondist.export`'s: a run's weights written in a format, with the
format's check line; a float16 ONNX graph (`half=True`) also scored on the run's val split beside
its float32 twin, so that the accuracy a conversion costs is printed before the file ships.

The exporters and the evaluation (torch, about 2 s) are imported when a job runs
(`# noqa: PLC0415 (a job's)`)."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from visiondist.api.jobs import CHATTY, EXPORT_SUFFIX, step_of
from visiondist.checkpoint.files import ema_wanted
from visiondist.cli.load import load_run_config
from visiondist.cli.tool import truth
from visiondist.config import ConfigError
from visiondist.utils.logs import held_at


def export_job(
    run_dir: Union[str, Path],
    fmt: str = "safetensors",
    step: Optional[Union[int, str]] = None,
    out: Optional[Union[str, Path]] = None,
    opset: Optional[Union[int, str]] = None,
    half: Union[bool, str] = False,
    int8: Union[bool, str] = False,
    ema: Union[bool, str] = False,
) -> Path:
    """tools/export.py's job: the run's weights (its newest checkpoint, `step`, else its
    model.safetensors; `ema`: the checkpoint's EMA of them, as does a step=best by an EMA metric)
    written as `fmt` (format=onnx: in ONNX `opset`; `half`: its network in float16; `int8`: its
    convolutions and matrix products quantized, calibrated on the run's train images; for both,
    the val split's accuracy before and after printed), with its check lines printed.

    Returns:
        The written file (hf: directory).
    """
    settings, precision = _settings(fmt, opset, half, int8)
    run_dir = Path(run_dir).expanduser()
    chosen = step_of(step) if step is not None else None
    averaged, said = ema_wanted(run_dir, chosen, as_flag("ema", ema))
    if said:
        print(said, flush=True)
    path = _out_path(run_dir, fmt, out, precision, averaged)
    from visiondist.checkpoint.export import export as export_run  # noqa: PLC0415 (a job's)
    from visiondist.checkpoint.export.hf import check_hf  # noqa: PLC0415 (a job's)
    from visiondist.checkpoint.export.onnx_check import (  # noqa: PLC0415 (a job's)
        check_onnx,
        openvino_check,
    )
    from visiondist.checkpoint.export.pt2 import check_pt2  # noqa: PLC0415 (a job's)
    from visiondist.checkpoint.export.torchscript import (  # noqa: PLC0415 (a job's)
        check_torchscript,
    )
    from visiondist.checkpoint.export.trained import load_trained  # noqa: PLC0415 (a job's)

    # as the tools' logging set-up holds them; a notebook sets up none
    with held_at(logging.ERROR, CHATTY):
        try:
            trained = load_trained(run_dir, chosen, averaged)
            files = export_run(trained, fmt, path, **settings)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        print(
            f"exported {trained.cfg.model.name} from {trained.source}"
            + (" (its EMA of the weights)" if trained.ema else "")
        )
        for file in files:
            print(f"  {file}")
        if _square_of_native(trained, fmt):
            print(_square_of_native(trained, fmt))
        others = _other_sources(path.parent, trained, [Path(f) for f in files])
        if others:
            print(f"  {path.parent} also holds {others}: out=<path> keeps exports apart")
        if fmt == "onnx":
            check = check_onnx(trained, path)
            print(
                "  onnxruntime not installed: output not checked"
                if check is None
                else f"  {check.summary()}"
            )
            if precision is not None and check is not None:
                with tempfile.TemporaryDirectory() as work:
                    full = Path(work) / "model_fp32.onnx"
                    plain = {k: v for k, v in settings.items() if k == "opset"}
                    export_run(trained, fmt, full, **plain)
                    print(f"  {accuracy_line(run_dir, full, path, Path(work), precision)}")
        if fmt == "hf" and (line := check_hf(trained, path)) is not None:
            print(f"  {line}")
        if fmt == "openvino":
            print(f"  {openvino_check(trained, path)}")
        if fmt == "pt2":
            print(f"  {check_pt2(trained, path)}")
        if fmt == "torchscript":
            print(f"  {check_torchscript(trained, path)}")
    return path


def _square_of_native(trained: Any, fmt: str) -> str:
    """The line an export of a native-resolution run's square model gets (format=naflex is the
    native one); "" for any other."""
    if str(trained.cfg.data.get("resolution", "square")) != "native" or fmt == "naflex":
        return ""
    size = int(trained.cfg.model.img_size)
    return (
        "  the run trained at native resolution; this is the square model "
        f"({size} x {size} px input, the same weights): format=naflex exports it for images at "
        "their own size and aspect ratio"
    )


def _other_sources(folder: Path, trained: Any, written: list[Path]) -> str:
    """The exported files in `folder` of other weights than `trained`'s, as each records them (a
    sidecar, an ONNX file's metadata): another step's, or the model's own beside the EMA
    ("model.onnx from step 50"); "" for none."""
    from visiondist.models.exported import own_record  # noqa: PLC0415 (onnx: its files')

    own = (str(trained.source), trained.step, trained.ema)
    found = []
    for file in sorted(folder.iterdir()) if folder.is_dir() else []:
        if file in written or file.suffix in (".json", ".bin") or not file.is_file():
            continue
        source = own_record(file).get("source")
        if not isinstance(source, dict) or "step" not in source:
            continue
        theirs = (source.get("path"), source.get("step"), "weights" in source)
        if theirs != own:
            ema = " (EMA)" if theirs[2] else ""
            found.append(f"{file.name} from step {source.get('step')}{ema}")
    return ", ".join(found)


def _settings(fmt: str, opset, half, int8) -> tuple[dict[str, Any], Optional[str]]:
    """The writer's settings of tools/export.py's keys, and the precision asked for ("float16",
    "int8", None); ConfigError for a format or a setting that does not exist or does not apply."""
    if fmt not in EXPORT_SUFFIX:
        raise ConfigError(f"format={fmt}: choose one of {', '.join(EXPORT_SUFFIX)}")
    half, int8 = as_flag("half", half), as_flag("int8", int8)
    if half and int8:
        raise ConfigError("half=true int8=true: give one (float16 or int8), not both")
    settings: dict[str, Any] = {"opset": _opset(opset)} if opset is not None else {}
    settings.update({"half": True} if half else {})
    settings.update({"int8": True} if int8 else {})
    takes = ("opset", "half", "int8") if fmt == "onnx" else ("opset",) if fmt == "openvino" else ()
    refused = [k for k in settings if k not in takes]
    if refused:
        given = " ".join(f"{k}={opset if k == 'opset' else 'true'}" for k in refused)
        which = "format=onnx and format=openvino" if refused == ["opset"] else "format=onnx"
        default = " (the default)" if fmt == "safetensors" else ""
        raise ConfigError(
            f"{given} applies to {which}, not format={fmt}{default}: add format=onnx, or drop "
            f"{given}"
        )
    return settings, "float16" if half else "int8" if int8 else None


def _out_path(run_dir: Path, fmt: str, out, precision: Optional[str], ema: bool = False) -> Path:
    """out=, else `<run>/export/model<_ema><_fp16|_int8><suffix>`; ConfigError where out='s suffix
    is another format's."""
    tag = ("_ema" if ema else "") + {"float16": "_fp16", "int8": "_int8", None: ""}[precision]
    path = Path(out) if out else run_dir / "export" / f"model{tag}{EXPORT_SUFFIX[fmt]}"
    named = [
        n for n, suffix in EXPORT_SUFFIX.items() if path.suffix and suffix.endswith(path.suffix)
    ]
    if named and fmt not in named and fmt != "hf":  # format=pt2 out=model.onnx
        raise ConfigError(
            f"out={out}: a {path.suffix} file is what format={named[0]} writes; format={fmt} "
            f"writes {EXPORT_SUFFIX[fmt]}: name it {path.stem}{EXPORT_SUFFIX[fmt]}, or give "
            f"format={named[0]}"
        )
    return path


def accuracy_line(run_dir: Path, before: Path, after: Path, work: Path, precision: str) -> str:
    """One line: the val split's headline metric of the float32 graph `before` and of the
    converted `after` (tools/eval.py's evaluation of each file, one process, under the run's
    config), and the change; or why it was not measured (the data is not on this machine)."""
    try:
        scores = [
            evaluate_file(run_dir, file, work / file.stem, said)
            for file, said in ((before, "the float32 graph"), (after, after.name))
        ]
    except ConfigError as exc:  # the val split is not here
        return f"val accuracy not measured: {str(exc).splitlines()[0]}"
    (name, a, images), (_, b, _) = (headline(s) for s in scores)
    unit = "%" if name == "top-1" else ""
    on = f" ({int(images)} images)" if images else ""
    change = f"{b - a:+.2f} points" if unit else f"{b - a:+.4f}"
    fmt = "{:.2f}%" if unit else "{:.4f}"
    return (
        f"val {name}{on}: {fmt.format(a)} float32 -> {fmt.format(b)} {precision} ({change}), each "
        "file evaluated by ONNX Runtime"
    )


def headline(metrics: dict[str, Any]) -> tuple[str, float, Optional[int]]:
    """An evaluation's one figure: ("top-1", percent) for a classifier, ("box mAP", mAP) for a
    detector, with the val images it counted."""
    key = "val_top1" if "val_top1" in metrics else "val_mAP"
    count = metrics.get("val_count")
    return ("top-1" if key == "val_top1" else "box mAP", float(metrics[key]), count)


def evaluate_file(
    run_dir: Path, weights: Path, out: Path, said: Optional[str] = None
) -> dict[str, Any]:
    """tools/eval.py's evaluation of an exported file under the run's config, in this process
    (one rank, no plots), its printed lines kept back but one progress line naming the file (or
    `said`): the metrics."""
    from visiondist.api.jobs import evaluate_job  # noqa: PLC0415 (a job's)

    overrides = [
        f"model.weights={weights}",
        "trainer.devices=1",
        "trainer.plots=false",
        "trainer.progress=false",
        f"trainer.run_dir={out}",
        # a file runs whole in one process, whatever layout trained it
        "parallel.name=ddp",
        "parallel.dp=-1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.fsdp=false",
    ]
    # a progress line (minutes on a large val split), beside the printed results
    print(f"scoring {said or weights.name} on the run's val split ...", file=sys.stderr, flush=True)
    with contextlib.redirect_stdout(io.StringIO()):  # the data's start-up line, once a file
        cfg = load_run_config(run_dir, overrides)
        return evaluate_job(cfg, None, own_dir=True)


def as_flag(key: str, value: Union[bool, str]) -> bool:
    """A true/false key of tools/export.py (or a bool from Python), as every tool reads one."""
    if isinstance(value, bool):
        return value
    return truth(key, str(value))


def _opset(value: Union[int, str]) -> int:
    """opset= as a number the exporters write (17 .. 20: what the TorchScript-based exporter of
    the torchvision detectors writes, and ONNX Runtime >= 1.17 reads)."""
    try:
        opset = int(value)
    except ValueError:
        opset = 0
    if not 17 <= opset <= 20:
        raise ConfigError(f"opset={value}: give an ONNX opset from 17 to 20 (default 18)")
    return opset
