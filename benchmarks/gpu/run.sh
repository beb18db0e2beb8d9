#!/usr/bin/env bash
# On one GPU machine with torch preinstalled and no network: install the wheels benchmarks/gpu/fetch_wheels.sh
# brought along (.whl/ at the repository root), then run the GPU tests (`pytest -m gpu`, which CI skips) and the GPU
# benchmark rows. Everything it prints also goes to $OUT (default benchmarks/gpu/out): device.txt, gpu_*.txt,
# bench_*.txt and the benchmark's results.jsonl / results.md. Each part runs even when an earlier one failed; the
# exit code is the number of parts that failed. Modes combine with '+' (`cudagraphs+mfu`).
# The test and benchmark modes first write a tree of real photos and train on it (the DeiT recipe, 30 steps, JPEGs
# decoded in the workers and on the device: under 2 minutes), so that a lent GPU runs the training path before anything
# else. `short` (4-7 minutes on an H200: the training check, the decode stress, step-rate and sync tests, ViT-B/16's
# step with decode_on=device against decoded batches) and `tests` (5 minutes: every GPU test) bound each part in time;
# `all` adds the benchmark rows (about 15 minutes on an H100).
# `mfu`: the goal rows: ViT-S/16 and ViT-B/16 with the DeiT recipe (on 2,048 real photos) each against the best plain
# loop (timm's ViT compiled whole, as timm's train.py does), ViT-H/14 in bf16 and float8 side by side; then one table
# (benchmarks/gpu/table.py: row, img/s, MFU, ours / best plain, goal) that fails on any row that compiled with a graph
# break, a recompile-limit hit or compiled while timed. Bounded to 6.5 minutes (ViT-S took 103 s and the DeiT row 79 s
# on an H100); it skips the training check.
# `kernels`: the switches toward the hardware's rate, each beside its default in one benchmark run: the attention
# kernels (model.sdpa auto against flash / cuDNN / memory-efficient, ViT-B/16), selective activation checkpointing
# (ViT-H/14 at batch 64 as is and at 128 with checkpoint_keep=matmuls), float8 (benchmarks/fp8_layers.py's table,
# ViT-L/H compiled in bf16 and both float8 recipes, and a 150-step run on the photos in bf16 and in float8, their
# losses side by side in fp8_loss.png). About 10 minutes on an H200.
# `detr`: the DETR criterion's one-synchronisation test, then RT-DETRv2-S, D-FINE-S and RF-DETR-N at their published
# input, bf16, batch 16, against plain loops over the transformers model (with its own loss) and over ours, each row
# with the Hungarian matching's host time beside the step's and the loader's rate (about 4 minutes; it skips the
# training check).
# `cudagraphs`: the CUDA-graph checks (the replayed model trains as the compiled one; the DeiT recipe's step with CUDA
# graphs never waits for the GPU), about 2 minutes. `profile`: benchmarks/vit_profile.py, where a ViT-S and a ViT-B
# step's time goes (ours against timm's, eager, per block and whole-model compiled, CUDA graphs): kernels by kind, top
# kernels, idle share (about 5 minutes). Both skip the training check, as `mfu` does.
# `layouts`: every layout's ranks on the machine's one GPU, sharing it over gloo (`trainer.share_gpu`; NCCL refuses two
# ranks on one device), each against one process on the same GPU: the multi-rank tests marked `layouts`
# (tests/devices.py, VISIONDIST_TEST_DEVICE=cuda-shared): dp2; tp2 with and without sequence parallelism; pp2 under
# GPipe, 1F1B, interleaved 1F1B and zero-bubble; FSDP2 and HSDP; dp2 x tp2; ViTDet's backbone under tp2; Faster R-CNN
# and RT-DETR under dp2; compiled tensor-parallel blocks; fp32 within the CPU tests' tolerances (TF32 off), bf16 within
# its stated one; a tp2 checkpoint written on the GPU resumed by one process and on the CPU; a 2-rank COCO evaluation
# equal to pycocotools; a rank killed ends the job within 60 s naming it; SIGTERM checkpoints every rank. Correctness
# only (not NCCL, not speed), in under 6 minutes; it skips the training check.
# `multi`: for a machine of 2-8 GPUs, one GPU per rank over NCCL (VISIONDIST_TEST_DEVICE=cuda): the same tests (those
# of more ranks than GPUs skip), then ViT-H/14 under tp4 (tp2 on 2-3 GPUs) timed by tools/benchmark.py, and the bytes
# its collectives moved per step against the planner's (benchmarks/gpu/traffic.py). Under 8 minutes; not run yet.
# `memory`: the memory plan against the allocator (benchmarks/memory_model.py --device cuda): ViT-B/16, ViT-L/16 and
# ViT-H/14 training steps, plain, accumulated and checkpointed, and ViT-B/16 under tp2 and pp2 with both ranks on the
# GPU, each planned GB beside max_memory_allocated and max_memory_reserved (a row more than 10% off fails the part).
# About 5 minutes; it skips the training check. Not run yet.
# `predict`: tools/predict.py's path against a plain PyTorch loop over the same model, batches and files, and the
# model alone on images decoded beforehand (benchmarks/predict.py): ViT-B/16 in bf16, compiled as the tool runs it,
# 2,048 real photos, batch 256. About 2 minutes; it skips the training check. Not run yet.
# `native`: data.resolution=native against square 224 px crops at the same token budget (benchmarks/native.py --part
# rate): ViT-B/16 in bf16, eager, batch 256's tokens a step, one image to a sequence and packed, at 98, 196 and 392
# patches, on 512 real photographs; images and tokens a second. Then the native GPU tests: its training step never
# waits for the GPU, and batches copied ahead train as copies waited for. About 6 minutes; it skips the training
# check. Not run yet.
# `levers`: what might take ViT-B/16 (DeiT recipe, 2,048 real photos) toward its goal, each beside the configuration as
# it ships in one benchmark run, compile counters read: float8 on the MLPs' linear layers only (trainer.fp8_layers=mlp,
# both recipes); Inductor's GEMM templates with the pointwise work fused into them (trainer.compile_autotune, a run of
# its own: minutes of compiling); batch 384 (a run of its own: a variant shares the batch). One table, each row's speed
# over its run's first (benchmarks/gpu/table.py --levers), failing on any compile fault. Bounded to 6.5 minutes.
# `levers_s`: the same for ViT-S/16 (autotuning; batch 512), 4.5 minutes. Both skip the training check; not run yet.
# `trt`: TensorRT builds the exported ONNX graphs (benchmarks/gpu/trt_check.py: a ViT-S/16, RT-DETRv2-R18 and a Faster
# R-CNN, trtexec with docs/deploy.md's shapes and --fp16), skipped where trtexec is not installed. About 3 minutes;
# it skips the training check. Not run yet.
#   usage: bash benchmarks/gpu/run.sh [tests|bench|mfu|kernels|detr|all|short|cudagraphs|profile|layouts|multi|memory|predict|native|levers|levers_s|trt][+...]
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
has() { [[ "+$what+" == *"+$1+"* ]]; }  # this mode was asked for (alone, or in a+b)
out=${OUT:-benchmarks/gpu/out}
mkdir -p "$out"
python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || { echo "the wheels in .whl/ did not install: run benchmarks/gpu/fetch_wheels.sh first"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VISIONDIST_DATA=/tmp/visiondist-data
failed=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__,
'| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())"
} 2>&1 | tee "$out/device.txt"

part() {  # seconds, log name, command...: run it bounded in time, its output to the screen and to $out/<log name>
    local seconds=$1 name=$2; shift 2
    timeout -k 5 "$seconds" "$@" 2>&1 | tee "$out/$name"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=$((failed + 1))
}
layout_tests=(-m layouts tests/multirank)  # each layout against one process (tests/devices.py)
if has layouts || has multi || has trt; then  # RT-DETR's layout test and trt_check need the DETR wheels
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-detr \
        .whl/detr/*.whl || echo "no DETR wheels in .whl/detr: the RT-DETR test skips (benchmarks/gpu/fetch_wheels.sh)"
fi
if has layouts; then  # the layouts' ranks sharing the one GPU over gloo
    VISIONDIST_TEST_DEVICE=cuda-shared PYTHONPATH=/tmp/site-detr:$PYTHONPATH part 345 gpu_layouts.txt \
        python3 -m pytest -p no:cacheprovider -n 4 --timeout 300 -rA "${layout_tests[@]}"
fi
if has memory; then  # the plan's GB against the caching allocator's peaks, the trainer's own steps
    part 420 memory_model.txt python3 benchmarks/memory_model.py --device cuda --out "$out/memory"
fi
if has multi; then  # a GPU per rank over NCCL: the same tests, ViT-H/14's TP step rate and its bytes against the plan
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    tp=$((gpus >= 4 ? 4 : 2))
    vith=(model=vit_huge data.img_size=224 data.batch_size=64 trainer.precision=bf16 "parallel=tp$tp")
    VISIONDIST_TEST_DEVICE=cuda PYTHONPATH=/tmp/site-detr:$PYTHONPATH part 300 gpu_multi_layouts.txt \
        python3 -m pytest -p no:cacheprovider -n 2 --timeout 280 -rA "${layout_tests[@]}"
    mkdir -p "$out/multi"
    part 150 bench_vit_huge_tp.txt python3 tools/benchmark.py trainer.accelerator=cuda bench.results_dir="$out/multi" \
        "${vith[@]}" "trainer.devices=$tp" bench.baseline=false bench.loader_batches=0
    part 30 multi_traffic.txt python3 benchmarks/gpu/traffic.py "$out/multi/results.jsonl" "${vith[@]}"
fi
if has cudagraphs; then  # the CUDA-graph checks alone: the replay test and a recipe run without syncs
    part 200 gpu_cudagraphs.txt python3 -m pytest -p no:cacheprovider -n 0 --timeout 190 -m gpu -rA \
        "tests/multirank/test_gpu.py::test_cuda_graphs_train_as_the_compiled_model_launched_kernel_by_kernel" \
        "tests/multirank/test_gpu.py::test_the_training_step_never_waits_for_the_gpu[device+deit]"
fi
if has profile; then
    part 330 vit_profile.txt python3 benchmarks/vit_profile.py --out "$out" --rows vit_small:256 \
        vit_base:256:timm_whole,split_blocks,ours_blocks,ours_whole
fi
if has predict; then  # prediction's images/s against a plain loop (its own DataLoader) and the model alone
    part 240 bench_predict.txt python3 benchmarks/predict.py --device cuda --precision bf16 --compile \
        --model vit_base --images 2048 --batch 256 --rounds 3 --markdown "$out/predict.md"
fi
if has native; then  # data.resolution=native: ViT-B/16's images and tokens a second against square 224 px batches
    part 240 bench_native.txt python3 benchmarks/native.py --part rate --model vit_base --device cuda \
        --precision bf16 --batch 256 --rounds 10 --photos 512 --work /tmp/native-bench
    # its steps never wait for the GPU (one image a sequence, packed), and batches copied ahead train as copies waited
    # for (ViT-S/16, 30 steps on real photos, three runs)
    part 420 gpu_native.txt python3 -m pytest -p no:cacheprovider -n 0 --timeout 400 -m gpu -rA \
        tests/multirank/test_gpu.py -k native
fi
photos="$VISIONDIST_DATA/photos-10240"  # what tests/multirank/test_gpu.py's photos fixture reads
if [[ -n $(echo "${what//+/ }" | tr ' ' '\n' | grep -vxE 'mfu|detr|profile|cudagraphs|layouts|multi|memory|predict|native|levers|levers_s|trt') ]]; then
    part 120 photos.txt python3 benchmarks/photos.py "$photos" --train 10240 --val 256
    # the training path on real photos first: DeiT recipe, decode in the workers (two seeds) and on the device
    part 330 gpu_training.txt python3 -m pytest -p no:cacheprovider -n 0 --timeout 320 -m gpu -rA \
        "tests/multirank/test_gpu.py::test_decode_on_device_trains_the_deit_recipe_as_the_loader_path_does"
fi

if has short; then
    part 260 gpu_tests.txt python3 -m pytest -p no:cacheprovider -n 0 --timeout 200 -m gpu -rA \
        tests/unit/test_gpu.py tests/multirank/test_gpu.py -k "never_writes or agree_on_the_step_rate or never_waits"
    part 170 bench_vit_base_decode.txt python3 tools/benchmark.py trainer.accelerator=cuda bench.results_dir="$out" \
        experiment=vit_b16_imagenet data.root="$photos" data.batch_size=256 bench.baseline=false \
        "bench.variants=['data.decode_on=device']"
fi
if has tests || has all; then
    part 900 gpu_tests.txt python3 -m pytest -p no:cacheprovider -n 0 -m gpu -rA tests/unit/test_gpu.py \
        tests/multirank/test_gpu.py -k "not deit_recipe"  # the training check ran first
fi

bench() {  # name, then tools/benchmark.py arguments
    local name=$1; shift
    python3 tools/benchmark.py trainer.accelerator=cuda bench.results_dir="$out" "$@" 2>&1 | tee "$out/bench_$name.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=$((failed + 1))
}
mfu_rows() {  # the goal rows, each against the best plain loop (timm's model compiled whole), then one table
    local small="$VISIONDIST_DATA/photos-2048" t0=$SECONDS
    part 60 photos_small.txt python3 benchmarks/photos.py "$small" --train 2048 --val 64
    timed_bench 100 vit_small model=vit_small data.img_size=224 data.batch_size=256 trainer.precision=bf16 \
        "bench.plain_loops=[reference]"
    timed_bench 110 vit_b16_deit experiment=vit_b16_imagenet data.root="$small" data.batch_size=256 \
        "bench.plain_loops=[reference]"
    # ViT-H/14 in bf16 and in float8 side by side (two whole-model compilations of 32 blocks: its plain loop on timm's
    # model is `bench`'s row, which would add two more)
    timed_bench 200 vit_huge model=vit_huge data.img_size=224 data.batch_size=64 trainer.precision=bf16 \
        bench.baseline=false "bench.variants=['trainer.fp8=rowwise']"
    python3 benchmarks/gpu/table.py "$out/results.jsonl" --markdown "$out/mfu.md" || failed=$((failed + 1))
    echo "mfu rows: $((SECONDS - t0)) s"
}
timed_bench() {  # seconds, name, then tools/benchmark.py arguments: bench, bounded in time, logged in one file
    # ($bench_log, default bench_mfu.txt), its rows in $bench_results (default $out)
    local seconds=$1 name=$2 log="$out/${bench_log:-bench_mfu.txt}"; shift 2
    echo "== $name: $*" | tee -a "$log"
    timeout -k 5 "$seconds" python3 tools/benchmark.py trainer.accelerator=cuda \
        bench.results_dir="${bench_results:-$out}" "$@" 2>&1 | tee -a "$log"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=$((failed + 1))
}
levers() {  # name, seconds, then tools/benchmark.py arguments: a lever's run (no plain loops), rows in $out/levers
    local name=$1 seconds=$2; shift 2
    bench_log=bench_levers.txt bench_results="$out/levers" timed_bench "$seconds" "$name" bench.baseline=false "$@"
}
if has levers || has levers_s; then
    t0=$SECONDS
    if has levers; then  # ViT-B/16, the DeiT recipe on real photos
        small="$VISIONDIST_DATA/photos-2048"
        part 60 photos_small.txt python3 benchmarks/photos.py "$small" --train 2048 --val 64
        deit=(experiment=vit_b16_imagenet data.root="$small")
        levers vit_b16_fp8_mlp 150 "${deit[@]}" data.batch_size=256 \
            "bench.variants=['trainer.fp8=rowwise trainer.fp8_layers=mlp','trainer.fp8=tensorwise trainer.fp8_layers=mlp']"
        # autotuning compiles for minutes: a run of its own, so that running out of time loses no other row
        levers vit_b16_autotune 210 "${deit[@]}" data.batch_size=256 "bench.variants=['trainer.compile_autotune=true']"
        levers vit_b16_batch384 70 "${deit[@]}" data.batch_size=384
    fi
    if has levers_s; then  # ViT-S/16 on its goal row's settings
        vits=(model=vit_small data.img_size=224 trainer.precision=bf16)
        levers vit_s16_autotune 180 "${vits[@]}" data.batch_size=256 "bench.variants=['trainer.compile_autotune=true']"
        levers vit_s16_batch512 70 "${vits[@]}" data.batch_size=512
    fi
    python3 benchmarks/gpu/table.py "$out/levers/results.jsonl" --levers --markdown "$out/levers.md" \
        || failed=$((failed + 1))
    echo "levers: $((SECONDS - t0)) s"
fi
if has bench || has all; then
    # eager and compiled (trainer.compile=auto compiles on CUDA: eager is asked for by name), each against its own
    # plain loops; ViT-B/L plain
    for row in "vit_base 256" "vit_large 128"; do
        set -- $row
        bench "$1" model="$1" data.img_size=224 data.batch_size="$2" trainer.precision=bf16 trainer.compile=false \
            "bench.variants=['trainer.compile=true']"
    done
fi
if has mfu || has bench || has all; then
    mfu_rows
fi
if has kernels || has all; then
    bench vit_base_attention model=vit_base data.img_size=224 data.batch_size=256 trainer.precision=bf16 \
        bench.baseline=false "bench.variants=['model.sdpa=flash','model.sdpa=cudnn','model.sdpa=efficient']"
    bench vit_huge_b64 model=vit_huge data.img_size=224 data.batch_size=64 trainer.precision=bf16 bench.baseline=false
    bench vit_huge_b128_keep_matmuls model=vit_huge data.img_size=224 data.batch_size=128 trainer.precision=bf16 \
        bench.baseline=false parallel.activation_checkpointing=true parallel.checkpoint_keep=matmuls
    part 240 bench_fp8_layers.txt python3 benchmarks/fp8_layers.py --markdown "$out/fp8_layers.md"
    for row in "vit_large 128" "vit_huge 64"; do
        set -- $row
        bench "$1_fp8" model="$1" data.img_size=224 data.batch_size="$2" trainer.precision=bf16 bench.baseline=false \
            "bench.variants=['trainer.fp8=tensorwise','trainer.fp8=rowwise']"
    done
    for recipe in off rowwise; do
        part 240 "train_fp8_$recipe.txt" python3 tools/train.py experiment=vit_b16_imagenet data.root="$photos" \
            trainer.max_steps=150 trainer.eval_every=0 trainer.log_every=10 trainer.fp8=$recipe \
            trainer.run_dir="$out/train_fp8_$recipe"
    done
    part 60 fp8_loss.txt python3 benchmarks/loss_curves.py "$out/train_fp8_off" "$out/train_fp8_rowwise" \
        --labels bf16 "fp8 rowwise" --png "$out/fp8_loss.png"
fi
if has bench || has all; then
    # the input path: per-core loader rates on real photos, nvJPEG and the device augmentation's share of a step
    python3 benchmarks/data_throughput.py --images 640 --rounds 3 --markdown "$out/data_throughput.md" \
        --json "$out/data_throughput.json" 2>&1 | tee "$out/bench_data_throughput.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=$((failed + 1))
    bench frcnn_r50 model=fasterrcnn_r50 data=shapes_coco data.min_size=800 data.max_size=1333 data.batch_size=8 \
        trainer.precision=bf16 "bench.variants=['model.channels_last=true']"
    bench maskrcnn_r50 model=maskrcnn_r50 data=shapes_coco data.min_size=800 data.max_size=1333 data.batch_size=8 \
        trainer.precision=bf16
fi
if has detr || has all; then
    # DETR-class detectors at their published input (640 px; RF-DETR-N 384), bf16, batch 16, fixed size (the
    # multi-scale draw off, so ours and the plain loops see the same pixels), each against the transformers model
    # in a plain loop and against our own model in one
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-detr \
        .whl/detr/*.whl || echo "the DETR wheels in .whl/detr did not install: run benchmarks/gpu/fetch_wheels.sh"
    # the criterion's step on the GPU under CUDA's sync debug mode: one synchronisation (the cost matrices' transfer)
    PYTHONPATH=/tmp/site-detr:$PYTHONPATH part 120 gpu_detr_sync.txt python3 -m pytest -p no:cacheprovider -n 0 \
        -m gpu -rA tests/unit/test_detr_criterion.py
    for model_size in rtdetr_v2_r18:640 dfine_s:640 rfdetr_nano:384; do  # the published input, over the tuned
        model=${model_size%:*}                                               # shapes_coco file's CPU sizes
        variants=()  # RF-DETR's network compiles in one graph (RT-DETR's and D-FINE's break at their denoising)
        [[ $model == rfdetr_nano ]] && variants=("bench.variants=['trainer.compile=model']")
        PYTHONPATH=/tmp/site-detr:$PYTHONPATH bench "$model" model="$model" data=shapes_coco data.batch_size=16 \
            trainer.precision=bf16 model.img_size="${model_size#*:}" model.num_queries=null model.multi_scale=null \
            ${variants[@]+"${variants[@]}"}
    done
fi
if has trt; then
    PYTHONPATH=/tmp/site-detr:$PYTHONPATH part 300 trt.txt python3 benchmarks/gpu/trt_check.py --out "$out/trt"
fi
echo "parts failed: $failed"
exit "$failed"
