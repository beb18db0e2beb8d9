"""The few APIs that differ between the supported torch releases (visiondist/compat.py), on the
torch installed here. CI runs this file on the newest torch and on torch 2.11."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from visiondist import compat

pytestmark = pytest.mark.smoke


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_collectives_and_timeouts_work_on_this_torch(one_rank):
    x = torch.arange(6.0).view(2, 3)
    out = torch.empty(2, 3)
    compat.all_gather_into(out, x, one_rank)
    assert torch.equal(out, x)
    compat.reduce_scatter_into(out, x * 2, one_rank)
    assert torch.equal(out, x * 2)
    compat.set_pg_timeout(timedelta(seconds=7))
    compat.set_pg_timeout(timedelta(seconds=7), dist.new_group([0]))


def test_the_pipeline_stage_methods_we_override_exist_with_their_parameters(monkeypatch):
    compat.check_pipeline_stage()
    from torch.distributed.pipelining import PipelineStage

    # what a release that removed it looks like
    monkeypatch.setattr(PipelineStage, "backward_weight_one_chunk", None)
    with pytest.raises(RuntimeError, match="PipelineStage.backward_weight_one_chunk is gone"):
        compat.check_pipeline_stage()


def test_tf32_is_switched_on_for_cuda_fp32_matmuls():
    from visiondist.engine.precision import set_tf32

    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        set_tf32(True)
        assert (
            torch.backends.cuda.matmul.fp32_precision,
            torch.backends.cudnn.conv.fp32_precision,
        ) == ("tf32",) * 2
        set_tf32(False)
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


def test_fsdp_gathers_bf16_weights_in_bf16_runs(one_rank):
    """The FSDP policy of a bf16 run: weights gathered for the forward are bf16 (half the all-gather
    bytes), the shards the optimizer updates stay fp32."""
    from omegaconf import OmegaConf

    from visiondist.config import ModelConfig
    from visiondist.models import build_model
    from visiondist.parallel import build_layout, parallelize

    cfg = OmegaConf.structured(
        ModelConfig(
            name="vit_tiny",
            img_size=32,
            num_classes=3,
            embed_dim=32,
            depth=2,
            num_heads=2,
            mlp_ratio=2.0,
            min_size=32,
            max_size=32,
        )
    )
    seen = []
    for dtype in (torch.bfloat16, None):
        model = build_model(cfg)
        model.blocks[0].register_forward_pre_hook(
            lambda m, _: seen.append(next(m.parameters()).dtype)
        )
        model = parallelize(
            model, build_layout(1, 1, 1, torch.device("cpu"), 0), fsdp=True, param_dtype=dtype
        )
        model(torch.randn(2, 3, 32, 32)).float().sum().backward()
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert seen == [torch.bfloat16, torch.float32]


def test_blocks_with_drop_path_share_their_compiled_graphs():
    """Per-block drop-path rates used to compile one graph per block (dynamo specialises on float
    attributes) and stop compiling at its recompile limit of 8: ViT-B/L/H ran most blocks eager."""
    from torch._dynamo.testing import CompileCounter

    from visiondist.models.vit import VisionTransformer
    from visiondist.parallel.fsdp import compile_blocks

    torch._dynamo.reset()
    model = VisionTransformer(
        img_size=32,
        patch_size=16,
        num_classes=3,
        embed_dim=32,
        depth=12,
        num_heads=2,
        drop_path_rate=0.2,
    )
    counter = CompileCounter()
    compile_blocks(model, backend=counter)
    model.train()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert counter.frame_count <= 2, counter.frame_count  # block 0 (rate 0) and the others


def test_each_rank_finds_its_gpu_also_when_bound_to_one():
    from visiondist.config import ConfigError
    from visiondist.launch import cuda_index

    assert [cuda_index(r, 8) for r in (0, 3, 7)] == [0, 3, 7]
    assert cuda_index(3, 1) == 0  # SLURM --gpus-per-task=1: every task sees its own GPU as cuda:0
    with pytest.raises(ConfigError, match="LOCAL_RANK=3 but this process sees 2 GPUs"):
        cuda_index(3, 2)


def test_the_flight_recorder_variable_is_the_one_this_torch_reads(tmp_path, monkeypatch):
    """The new name where torch's sources read it (no deprecation warning at every NCCL start), else
    the old."""
    from types import SimpleNamespace

    name = compat.flight_recorder_env()
    header = next(iter(torch.__path__)) + "/include/torch/csrc/distributed/c10d/FlightRecorder.hpp"
    from pathlib import Path

    if Path(header).is_file():  # the installed torch's own reading of it
        assert name in Path(header).read_text()
    fake = tmp_path / "torch"
    (fake / "include/torch/csrc/distributed/c10d").mkdir(parents=True)
    (fake / "include/torch/csrc/distributed/c10d/FlightRecorder.hpp").write_text(
        'max_entries_ = getCvarInt({"TORCH_NCCL_TRACE_BUFFER_SIZE"}, 0);'
    )
    monkeypatch.setattr(compat, "torch", SimpleNamespace(__file__=str(fake / "__init__.py")))
    assert compat.flight_recorder_env() == "TORCH_NCCL_TRACE_BUFFER_SIZE"
    (fake / "include/torch/csrc/distributed/c10d/FlightRecorder.hpp").write_text(
        'max_entries_ = getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000);'
    )
    assert compat.flight_recorder_env() == "TORCH_FR_BUFFER_SIZE"


def test_torchaos_invalid_escapes_are_not_warned_and_nothing_else_is_hidden():
    """Compiling torchao's sources (where no bytecode is cached) warns of an invalid escape
    sequence: not shown after quiet_pytree; the same in another file still is."""
    import warnings

    source = 'pattern = "a\\.b"\n'
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.quiet_pytree()
        compile(source, "/site-packages/torchao/quantization/quant_api.py", "exec")
        assert not seen
        compile(source, "/home/me/train.py", "exec")
        assert len(seen) == 1 and "invalid escape sequence" in str(seen[0].message)


def test_the_rendezvous_names_its_events_as_before_without_reading_sources(monkeypatch):
    """`quick_rendezvous_names` gives the name torch's own `get_method_name` gives (the caller
    `depth` frames up), at any depth, without `inspect.stack()` (each call of which read every
    frame's source: over a second of every launch of several ranks)."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    # torch's own (a launch earlier in this process may have put the quick one in its place, which
    # keeps it)
    original = getattr(
        dynamic_rendezvous.get_method_name, "original", dynamic_rendezvous.get_method_name
    )
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)
    assert compat.quick_rendezvous_names() and dynamic_rendezvous.get_method_name is not original
    assert compat.quick_rendezvous_names()  # once patched, left as it is
    quick = dynamic_rendezvous.get_method_name

    def record(name_of, depth):  # as the rendezvous' _record calls it, inside one of its methods
        return name_of() if depth is None else name_of(depth)

    def next_rendezvous(name_of, depth=None):
        return record(name_of, depth)

    for depth in (None, 1, 2, 3, 10_000):
        assert next_rendezvous(quick, depth) == next_rendezvous(original, depth), depth
    assert next_rendezvous(quick) == "next_rendezvous"
    stack = []
    monkeypatch.setattr(inspect, "stack", lambda *a: stack.append(a) or [])
    next_rendezvous(quick)
    assert not stack
