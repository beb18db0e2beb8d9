#!/usr/bin/env bash
# Run where pip reaches PyPI: download, into .whl/ at the repository root, the wheels the GPU machine lacks for
# Python 3.12 on x86-64 Linux. That machine has torch 2.11 + torchvision 0.26 (CUDA 13), timm, numpy, OpenCV,
# matplotlib, rich, safetensors, tensorboard, onnx, scikit-image and pytest, and no network; benchmarks/gpu/run.sh
# installs these (defusedxml: Pascal VOC's XML). albucore is pinned to the version albumentations 2.0.8 asks for
# (pip download --no-deps would take the newest, which needs numkong). No TorchCodec: PyPI's wheel has no CUDA
# decoder and is built for one torch release; data.decode_on=device decodes with torchvision's nvJPEG there.
# antlr4-python3-runtime 4.9.3 (omegaconf's parser runtime) is published as a source archive only: it is built into
# a wheel here (pure Python, so the wheel runs anywhere).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
platform=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platform[@]}" -d .whl "$@"
}
download "hydra-core==1.3.2" "omegaconf==2.3.0" "albumentations==2.0.8" "albucore==0.0.24" "pydantic>=2" \
    "pydantic-core" "annotated-types" "typing-inspection" "stringzilla" "simsimd" "pycocotools>=2.0.8" \
    "faster-coco-eval>=1.6" "torchao==0.18.0" "defusedxml"
python3 -m pip wheel --quiet --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
# the DETR-class detectors' extra (transformers and what it needs), apart: run.sh installs them for its detr part only,
# so that a newer huggingface_hub never shadows the one timm uses elsewhere
mkdir -p .whl/detr
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform[@]}" -d .whl/detr "transformers==5.24.0" "huggingface-hub==2.4.0" "tokenizers==0.23.3" "hf-xet" \
    "httpx2" "httpcore2" "h11>=0.16" "anyio" "idna" "truststore" "typing-extensions>=4.16" "regex" "typer" \
    "click>=8.4.2" "shellingham" "annotated-doc" "safetensors>=0.8.0" "fsspec" "filelock" "scipy"
# pydantic pins pydantic-core exactly: keep the matching one only
python3 - <<'PY'
import pathlib, re, zipfile
whl = pathlib.Path(".whl")
meta = zipfile.ZipFile(next(whl.glob("pydantic-2*.whl"))).read
name = next(n for n in zipfile.ZipFile(next(whl.glob("pydantic-2*.whl"))).namelist() if n.endswith("METADATA"))
want = re.search(r"pydantic-core==([\w.]+)", meta(name).decode()).group(1)
for core in whl.glob("pydantic_core-*.whl"):
    if not core.name.startswith(f"pydantic_core-{want}-"):
        core.unlink()
print("pydantic-core", want)
PY
ls -la .whl
du -sh .whl
