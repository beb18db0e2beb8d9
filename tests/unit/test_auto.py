"""parallel=auto: the planner's choices on paper (configs from configs/), and its refusals."""

from pathlib import Path

import pytest

from visiondist.config import ConfigError, compose
from visiondist.models.shape import ViTShape
from visiondist.plan import plan_for, resolve
from visiondist.plan.planner import plan
from visiondist.plan.resolve import auto_words
from visiondist.plan.time_model import Candidate, Hardware

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _cfg(*overrides):
    # host memory pinned (a GPU node's 2 TB): the default, this machine's memory, would make
    # offload's fit vary
    return compose(
        CONFIGS,
        [
            "data=imagenet",
            "data.root=/data",
            "data.num_classes=1000",
            "parallel=auto",
            "parallel.host_memory_gb=2000",
            *overrides,
        ],
    )


def test_ddp_for_vit_base_on_80gb_devices():
    result = plan_for(_cfg("model=vit_base"), devices=8, nodes=1, memory_gb=80)
    assert result.choice.candidate == Candidate(dp=8)
    assert "fit each device under DDP" in result.reason


def test_ddp_is_kept_where_it_fits_and_a_much_faster_layout_is_named_beside_it():
    """ViT-g over 2 nodes of 8: DDP fits and stays the choice; the time model puts HSDP 1.5x
    ahead, which the reason says with the settings that select it. ViT-B on one node: nothing
    1.2x ahead, nothing said."""
    cfg = _cfg("model=vit_giant", "trainer.precision=bf16")
    result = plan_for(cfg, devices=16, nodes=2, memory_gb=80)
    assert result.choice.candidate == Candidate(dp=16)
    said = result.reason.split("; the time model puts ", 1)
    assert len(said) == 2 and " selects it" in said[1] and "parallel.fsdp=true" in said[1]
    base = plan_for(_cfg("model=vit_base"), devices=8, nodes=1, memory_gb=80)
    assert "the time model puts" not in base.reason
    # a step the launches decide (2 ViT-Ti blocks, 16 images of 32 px a step): nothing named,
    # where the time model put a 2-stage pipeline 1.5x ahead of DDP's 0.019 ms
    tiny = _cfg("model=vit_tiny", "model.depth=2", "data.batch_size=16", "data.img_size=32")
    assert "the time model puts" not in plan_for(tiny, devices=2, nodes=1, memory_gb=80).reason


def test_fsdp_or_tp_inside_a_node_when_the_state_does_not_fit_one_device():
    cfg = _cfg("model=vit_giant", "data.batch_size=256", "trainer.precision=bf16")
    result = plan_for(cfg, devices=8, nodes=1, memory_gb=16)
    ddp = next(r for r in result.rows if r.candidate == Candidate(dp=8))
    # parameters + gradients + AdamW alone exceed the device
    assert ddp.memory.state > result.hardware.budget
    c = result.choice.candidate
    assert c.fsdp or c.tp > 1
    assert c.pp == 1
    assert result.choice.memory.device <= result.hardware.budget
    assert "DDP would need" in result.reason


def test_pipeline_across_nodes_when_tensor_parallel_inside_a_node_is_not_enough():
    cfg = _cfg("model=vit_22b", "trainer.precision=bf16")
    result = plan_for(cfg, devices=16, nodes=2, memory_gb=80)
    assert result.choice.candidate.pp > 1
    within_node = [
        r for r in result.rows if r.candidate.pp == 1 and not r.candidate.fsdp and r.memory
    ]
    # TP went as far as the node allows
    assert within_node and max(r.candidate.tp for r in within_node) == 8
    # inside a node, TP fits the batch only by accumulating (smaller micro-batches), and the
    # pipeline is faster
    assert all(r.candidate.accum > 1 for r in within_node if r.fits)
    assert all(r.seconds["total"] > result.choice.seconds["total"] for r in within_node if r.fits)


def test_refuses_with_the_smallest_device_count_that_fits():
    # 64 GB of host memory a node: offload cannot hold ViT-22B's state, and accumulation lowers only
    # activations
    cfg = _cfg("model=vit_22b", "trainer.precision=bf16", "parallel.host_memory_gb=64")
    result = plan_for(cfg, devices=8, nodes=1, memory_gb=16)
    assert result.choice is None
    assert "the smallest that fits is 32 devices (4 nodes of 8)" in result.reason
    assert plan_for(cfg, devices=32, nodes=4, memory_gb=16).choice is not None
    assert plan_for(cfg, devices=24, nodes=3, memory_gb=16).choice is None
    with pytest.raises(ConfigError, match="smallest that fits is 32 devices"):
        resolve(
            _cfg(
                "model=vit_22b",
                "trainer.precision=bf16",
                "parallel.device_memory_gb=16",
                "parallel.host_memory_gb=64",
                "trainer.devices=8",
                "trainer.accelerator=cpu",
            ),
            {},
            0,
        )


def test_accumulation_or_checkpointing_whichever_the_time_model_finds_cheaper():
    # one device, vit_base, batches whose activations (not the state) overflow
    shape = ViTShape(768, 12, 12, 4.0, 16, 224, 1000)
    large = plan(shape, Hardware(devices=1, memory_gb=16), global_batch=256, precision="bf16")
    # 128 images a micro-batch keep the matmuls busy
    assert large.choice.candidate == Candidate(dp=1, accum=2)
    assert large.choice.memory.detail["micro_batch"] == 128
    ckpt = next(r for r in large.rows if r.candidate == Candidate(dp=1, checkpointing=True))
    # recomputing costs a third more
    assert ckpt.fits and ckpt.seconds["total"] > large.choice.seconds["total"]
    small = plan(shape, Hardware(devices=1, memory_gb=1.8), global_batch=8, precision="bf16")
    # accumulating would leave 1-image matmuls
    assert small.choice.candidate == Candidate(dp=1, checkpointing=True)
    accumulated = next(
        r for r in small.rows if r.candidate.accum > 1 and not r.candidate.checkpointing
    )
    assert accumulated.fits and accumulated.memory.detail["micro_batch"] == 1
    assert accumulated.seconds["total"] > 1.5 * small.choice.seconds["total"]


def test_auto_resolves_to_a_concrete_layout_and_leaves_the_config_as_asked():
    cfg = _cfg(
        "model=vit_small",
        "data=shapes",
        "parallel.device_memory_gb=0.05",
        "trainer.devices=4",
        "trainer.accelerator=cpu",
    )
    run, result = resolve(cfg, {}, 0)
    c = result.choice.candidate
    # not DDP: its state alone is 0.35 GB per device
    assert (c.dp, c.tp, c.pp, c.fsdp) != (4, 1, 1, False)
    assert (run.dp, run.tp, run.pp, run.fsdp, run.offload, run.activation_checkpointing) == (
        c.dp,
        c.tp,
        c.pp,
        c.fsdp,
        c.offload,
        c.checkpointing,
    )
    assert run.world_size == 4 and run.chosen_by == "parallel=auto" and run.reason == result.reason
    assert run.checkpoint_blocks in (0, cfg.model.depth)  # no -1 left
    # the config is not rewritten: config.yaml keeps the request
    assert cfg.parallel.auto and cfg.parallel.dp == -1
    assert result.choice.memory.device <= 0.9 * 0.05e9


def test_a_continued_auto_run_keeps_the_layout_it_started_with(tmp_path):
    from visiondist.config.layout import RunLayout

    first = RunLayout("cpu", 4, 4, dp=2, tp=2, chosen_by="parallel=auto")
    first.save(tmp_path)
    cfg = _cfg(
        "model=vit_small",
        "data=shapes",
        "trainer.devices=4",
        "trainer.accelerator=cpu",
        f"trainer.run_dir={tmp_path}",
    )
    run, plan = resolve(cfg, {}, 0)
    assert plan is None and (run.dp, run.tp, run.pp) == (2, 2, 1)  # not re-planned (DDP would fit)
    assert "layout.json" in run.reason
    # said as the layout it is, not as plain DDP (the console and train.log alike)
    assert auto_words(run) == "dp=2 tp=2 pp=1 (4 ranks on cpu)" and not run.plain_ddp
    other = _cfg(
        "model=vit_small",
        "data=shapes",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        f"trainer.run_dir={tmp_path}",
    )
    # another world: planned afresh (checkpoints reshard)
    assert resolve(other, {}, 0)[1] is not None


def test_auto_is_the_default_and_is_plain_ddp_when_the_state_fits():
    default = compose(CONFIGS, ["trainer.accelerator=cpu"])  # the README's main job
    assert default.parallel.auto
    run, result = resolve(default, {}, 0)
    assert (run.world_size, run.dp, run.tp, run.pp, run.fsdp, run.activation_checkpointing) == (
        1,
        1,
        1,
        1,
        False,
        False,
    )
    assert run.chosen_by == "parallel=auto" and "fit each device under DDP" in run.reason
    # where the budget comes from
    assert "the host's" in run.reason and "1 rank per node (CPU)" in run.reason
    two, _ = resolve(compose(CONFIGS, ["trainer.accelerator=cpu", "parallel.dp=2"]), {}, 0)
    assert (two.world_size, two.dp, two.tp) == (2, 2, 1)  # parallel.dp=N: N ranks, still DDP
    # every field the ranks read is what parallel=ddp gives: the default run is the DDP run, only
    # its label differs
    for overrides in ([], ["parallel.dp=2"], ["model=vit_base", "data.batch_size=256"]):
        auto, _ = resolve(compose(CONFIGS, ["trainer.accelerator=cpu", *overrides]), {}, 0)
        ddp, _ = resolve(
            compose(CONFIGS, ["trainer.accelerator=cpu", "parallel=ddp", *overrides]), {}, 0
        )
        assert auto.replace(chosen_by=ddp.chosen_by, reason=ddp.reason, plain_ddp=False) == ddp
        assert auto.plain_ddp and auto_words(auto).startswith("plain DDP on "), overrides


def test_plain_ddp_with_the_configured_accumulation_is_said_as_plain_ddp():
    """trainer.grad_accum=2 as configured: plain DDP in the console's and train.log's words (the
    layout's own description shows the accumulation); the planner's own accumulation is not."""
    cfg = compose(CONFIGS, ["trainer.accelerator=cpu", "parallel.dp=2", "trainer.grad_accum=2"])
    run, plan = resolve(cfg, {}, 0)
    assert "+accumulation x2" in run.describe() and plan.plain_ddp and run.plain_ddp
    assert auto_words(run) == "plain DDP on 2 ranks (cpu)"
    # the planner adds accumulation to fit: its layout, said as such
    tight = _cfg("trainer.accelerator=cpu", "model=vit_base", "parallel.device_memory_gb=16")
    run, plan = resolve(tight, {}, 0)
    assert run.grad_accum == 16 and not plan.plain_ddp and not run.plain_ddp
    assert auto_words(run) == run.describe()


def test_auto_shards_vit_huge_only_when_ddp_does_not_fit():
    def run_for(memory_gb):
        return resolve(
            compose(
                CONFIGS,
                [
                    "model=vit_huge",
                    "parallel.dp=2",
                    "trainer.accelerator=cpu",
                    f"parallel.device_memory_gb={memory_gb}",
                ],
            ),
            {},
            0,
        )

    big, _ = run_for(80)
    assert (big.dp, big.tp, big.pp, big.fsdp) == (2, 1, 1, False)
    small, result = run_for(8)
    assert (small.dp, small.tp, small.pp, small.fsdp, small.activation_checkpointing) != (
        2,
        1,
        1,
        False,
        False,
    )
    assert "DDP would need 14 GB per device, over the 7.2 GB" in result.reason
    assert "parallel.device_memory_gb" in result.reason


def test_detectors_under_auto_run_ddp():
    cfg = compose(
        CONFIGS,
        [
            "model=fasterrcnn_mobilenet_v3",
            "data=shapes_coco",
            "trainer.accelerator=cpu",
            "parallel.dp=2",
        ],
    )
    run, result = resolve(cfg, {}, 0)
    assert result is None and (run.dp, run.tp, run.pp, run.fsdp) == (2, 1, 1, False)
    assert run.chosen_by == "parallel=auto" and "detector" in run.reason


def test_offloaded_state_must_fit_the_nodes_host_memory():
    # ViT-22B on 8 x 16 GB: FSDP + offload fits the devices, with 43.5 GB of state per rank in host
    # memory
    def result_for(host_gb, *more):
        cfg = compose(
            CONFIGS,
            [
                "model=vit_22b",
                "data.num_classes=1000",
                "parallel.device_memory_gb=16",
                f"parallel.host_memory_gb={host_gb}",
                *more,
            ],
        )
        return plan_for(cfg, devices=8, nodes=1, memory_gb=16)

    big = result_for(2000)
    assert big.choice.candidate == Candidate(dp=8, fsdp=True, offload=True)
    assert 8 * big.choice.memory.host <= 0.9 * 2000e9
    small = result_for(64)  # 348 GB a node cannot live in 64 GB
    assert small.choice is None
    assert (
        "and 57.6 GB (90% of 64 GB) of host memory per node (parallel.host_memory_gb)"
        in small.reason
    )
    offloaded = [r for r in small.rows if r.candidate.offload and r.memory]
    assert offloaded and all(
        r.note == "host" and not r.fits and r.memory.device <= small.hardware.budget
        for r in offloaded
    )


def test_on_the_cpu_offload_shares_the_hosts_memory_with_the_devices():
    from visiondist.plan.time_model import Hardware

    shape = ViTShape(1280, 32, 16, 4.0, 14, 224, 1000)  # ViT-H: 10 GB of fp32 AdamW state
    apart = plan(shape, Hardware(devices=1, memory_gb=8, host_memory_gb=16), global_batch=8)
    assert apart.choice.candidate.offload  # the state goes to the host, the device holds the rest
    m = apart.choice.memory
    shared = Hardware(
        devices=1, memory_gb=8, host_memory_gb=(m.host + m.device) / 0.9e9 * 0.99, shared_host=True
    )
    assert not shared.host_fits(m)  # the same bytes, but device and host are one memory
    assert Hardware(
        devices=1, memory_gb=8, host_memory_gb=(m.host + m.device) / 0.9e9 * 1.01, shared_host=True
    ).host_fits(m)


@pytest.mark.parametrize(
    "overrides,world",
    [
        (["parallel.num_devices=16", "parallel.nodes=2"], (16, 2)),
        (["parallel.dp=4", "parallel.tp=2"], (8, 1)),  # the ranks tools/train.py would start
        (["trainer.devices=8", "parallel.nodes=2"], (16, 2)),
    ],
)
def test_the_devices_a_plan_is_for(overrides, world):
    from visiondist.plan.world import planning_world

    assert planning_world(_cfg("model=vit_base", *overrides), cuda_devices=0) == world
    with pytest.raises(ConfigError, match="no GPU here: say how many devices to plan for"):
        planning_world(_cfg("model=vit_base"), cuda_devices=0)


def test_the_figures_the_layout_docs_quote_are_the_planners():
    """docs/data-parallel.md, training.md and pipeline-parallel.md quote the planner for ViT-B/16
    and ViT-H/14 at batch 1024 in bf16: each figure is what it plans today."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    text = " ".join(
        " ".join((docs / f).read_text().split())
        for f in ("data-parallel.md", "training.md", "pipeline-parallel.md")
    )

    def gb(row) -> str:
        return f"{row.planned()[0].device / 1e9:.3g} GB"

    def row(result, name):
        return next(r for r in result.rows if r.candidate.name == name)

    base = plan_for(_cfg("model=vit_base", "trainer.precision=bf16"), 8, 1, 80)
    assert base.choice is not None and base.choice.candidate.name == "ddp8"
    memory = base.choice.planned()[0]
    assert f"needs {gb(base.choice)} per device as `ddp8`" in text
    assert f"bf16: {gb(base.choice)} per device as ddp8" in text
    assert f"{memory.state / 1e9:.3g} GB of training state" in text
    assert f"{(memory.activations + memory.buffers) / 1e9:.3g} GB of activations" in text

    huge = plan_for(_cfg("model=vit_huge", "trainer.precision=bf16"), 8, 1, 24)
    # plain DDP (no accumulation) is not a row of its own: the reason names what it needs
    need = huge.reason.split("DDP would need ")[1].split(" per device")[0]
    assert f"ViT-H/14 would need {need} per 24 GB device" in text
    state = row(huge, "ddp8 +accum8").planned()[0].state  # accumulation leaves the state
    assert f"{state / 1e9:.3g} GB of it state" in text
    pipe = row(huge, "ddp4 x pp2(m=16)")
    ms = 1e3 * pipe.planned()[1]["total"]
    assert f"`ddp4 x pp2(m=16)` at {gb(pipe)} per device ({ms:.0f} ms per step" in text
    assert f"where DDP would need {need}" in text
    assert huge.choice is not None
    chosen, seconds = huge.choice.candidate.name, huge.choice.planned()[1]["total"]
    assert f"chooses `{chosen}` ({gb(huge.choice)}, {1e3 * seconds:.0f} ms)" in text
