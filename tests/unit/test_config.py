"""Bad input fails before anything starts, with one message that names the fix: composition,
presets, the layout resolved against the world, per-group validation and the family's capabilities.
The command line's exit code: tests/multirank/test_config.py."""

import pytest
from helpers import REPO
from omegaconf import OmegaConf

from visiondist.cli import load_config, run_tool
from visiondist.config import ConfigError, compose
from visiondist.plan import resolve

CONFIGS = REPO / "configs"


def _error(overrides):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS, overrides)
    return str(info.value)


def test_a_missing_checkpoint_step_names_the_steps_there(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in (12, 3):
        (checkpoints / f"step_{step}").mkdir(parents=True)
    error = _error([f"trainer.resume={checkpoints / 'step_99'}"])
    assert error.endswith(f"; {checkpoints} holds step_3, step_12"), error
    assert "no such checkpoint or run directory" in _error([f"trainer.resume={tmp_path / 'x'}"])


def test_defaults_compose_and_follow_the_data():
    cfg = load_config(CONFIGS, [])
    assert (
        cfg.model.name,
        cfg.data.name,
        cfg.parallel.name,
        cfg.optim.name,
        cfg.schedule.name,
    ) == ("vit_tiny", "shapes", "auto", "adamw", "cosine")
    assert cfg.model.img_size == cfg.data.img_size and cfg.model.num_classes == cfg.data.num_classes
    cfg = load_config(
        CONFIGS, ["model=vit_base", "model.img_size=96", "model.num_classes=3", "data.img_size=64"]
    )
    assert (cfg.model.img_size, cfg.model.num_classes, cfg.model.embed_dim) == (96, 3, 768)


def test_a_tuned_pair_sets_its_defaults_and_the_command_line_still_wins():
    base = load_config(
        CONFIGS, ["model=fasterrcnn_mobilenet_v3", "data=coco", "data.root=/data"], inputs=None
    )  # no tuned file for this pair
    assert (base.optim.lr, base.trainer.max_epochs, base.model.min_size) == (5e-4, 3, 800)
    tuned = load_config(CONFIGS, ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco"])
    assert (
        tuned.optim.lr,
        tuned.trainer.max_epochs,
        tuned.data.min_size,
        tuned.model.min_size,
    ) == (1e-3, 2, 256, 256)
    assert tuned.model.roi_sampling_ratio == 1
    mine = load_config(
        CONFIGS,
        [
            "model=fasterrcnn_mobilenet_v3",
            "data=shapes_coco",
            "optim.lr=2e-3",
            "trainer.max_epochs=4",
            "data.min_size=160",
        ],
    )
    assert (mine.optim.lr, mine.trainer.max_epochs, mine.model.min_size) == (2e-3, 4, 160)


def test_patch14_models_take_the_largest_fitting_input_size():
    # 64-pixel shapes, 14-pixel patches
    assert load_config(CONFIGS, ["model=vit_huge"]).model.img_size == 56
    assert (
        load_config(
            CONFIGS, ["model=vit_huge", "data=imagenet", "data.root=/data"], inputs=None
        ).model.img_size
        == 224
    )
    assert load_config(CONFIGS, ["model=vit_tiny", "data.img_size=70"]).model.img_size == 64


@pytest.mark.parametrize(
    "name,tp,dp", [("tp2", 2, -1), ("tp4", 4, -1), ("tp8", 8, -1), ("dp2_tp2", 2, 2)]
)
def test_parallel_presets(name, tp, dp):
    cfg = load_config(CONFIGS, ["model=vit_huge", f"parallel={name}"])
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.sequence_parallel) == (
        tp,
        dp,
        1,
        False,
    )


@pytest.mark.parametrize(
    "name,dp,tp,pp,micro",
    [("pp2", -1, 1, 2, 4), ("pp4", -1, 1, 4, 8), ("tp2_pp2", -1, 2, 2, 4), ("dp2_pp2", 2, 1, 2, 4)],
)
def test_pipeline_presets(name, dp, tp, pp, micro):
    cfg = load_config(CONFIGS, ["model=vit_base", f"parallel={name}"])
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.schedule, p.microbatches) == (dp, tp, pp, "1f1b", micro)
    run, _ = resolve(cfg, {}, 0)
    assert run.world_size == max(dp, 1) * tp * pp
    # nothing left at -1
    assert (run.schedule, run.stages_per_rank, run.microbatches) == ("1f1b", 1, micro)


def test_pipeline_batch_must_split_into_microbatches():
    with pytest.raises(
        ConfigError,
        match=r"dp x trainer.grad_accum x parallel.microbatches = 2 x 1 x 4: .* "
        r"use e.g. data.batch_size=24",
    ):
        _plan(["parallel=dp2_pp2", "data.batch_size=20"])
    assert _plan(["parallel=dp2_pp2", "data.batch_size=24"]).world_size == 4


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["model=vit_small", "parallel.tp=4"],
            "parallel.tp=4 does not divide model.num_heads=6 (vit_small): tensor parallelism "
            "shards attention by whole heads; use parallel.tp in {1, 2, 3, 6}, or "
            "model.num_heads=8 (a multiple of 4 that divides model.embed_dim=384: no longer timm's "
            "vit_small), or "
            "model=vit_base, timm's next ViT that parallel.tp=4 divides",
        ),
        (["model=vit_nope"], "model=vit_nope is not an option of model: did you mean model=vit_"),
        (["model=resnet"], "model=resnet is not an option of model: the options are dfine_n,"),
        (
            ["parallel=tp3"],
            "parallel=tp3 is not a named layout: set the degree itself, parallel.tp=3",
        ),
        (["optim.lr=-0.1"], "optim.lr=-0.1 must be > 0"),
        (["optim.lr=fast"], "optim.lr=fast: give a number"),
        (["optim.lr=nan"], "optim.lr=nan must be a finite number > 0"),
        (["trainer.max_steps=abc"], "trainer.max_steps=abc: give a whole number"),
        (["trainer.progress=maybe"], "trainer.progress=maybe: give true or false"),
        (
            ["trainer.checkpoint_every_min=nan"],
            "trainer.checkpoint_every_min=nan: give the minutes between checkpoints, e.g. 30 (0: "
            "only at the end of the run and on a stop)",
        ),
        (["trainer.checkpoint_every_min=-1"], "trainer.checkpoint_every_min=-1: give the minutes"),
        (
            ["trainer.max_stepz=3"],
            "trainer.max_stepz is not a setting: did you mean trainer.max_steps?",
        ),
        (["+trainer.foo=1"], "trainer.foo is not a setting (trainer has"),
        (["data.root"], "data.root: not an override; write key=value or group=option"),
        (
            ["parallel.tp=2"],
            "use parallel.tp in {1, 3}, or model.num_heads=4 (a multiple of 2 that divides",
        ),
        # degrees the node's ranks hold (vit_huge's 16 heads on 8 devices: not 16)
        (
            ["model=vit_huge", "parallel.tp=3", "trainer.devices=8"],
            "use parallel.tp in {1, 2, 4, 8}",
        ),
        (["trainer.precision=half"], "trainer.precision='half' is not supported"),
        (["model.img_size=70"], "not a multiple of model.patch_size=16"),
        (["parallel.pp=20"], "parallel.pp=20 pipeline stages exceed model.depth=12"),
        (
            ["parallel=pp4", "parallel.schedule=zero_bubble", "parallel.stages_per_rank=4"],
            "parallel.pp=4 x parallel.stages_per_rank=4 = 16 pipeline stages exceed model.depth=12",
        ),
        (["parallel=pp4", "parallel.microbatches=2"], "parallel.microbatches=2 < parallel.pp=4"),
        (
            ["parallel=pp4", "parallel.schedule=interleaved_1f1b", "parallel.microbatches=9"],
            "parallel.microbatches=9 must be a multiple of 2",
        ),
        (
            ["parallel=pp2", "parallel.schedule=gpipe", "parallel.stages_per_rank=2"],
            "parallel.schedule=gpipe runs one stage per rank",
        ),
        (
            ["parallel=pp2", "parallel.schedule=pipedream"],
            "parallel.schedule='pipedream' is not supported",
        ),
        (["optim.layer_decay=0"], "optim.layer_decay=0.0 must be in (0, 1]"),
        (["trainer.ema_decay=1"], "trainer.ema_decay=1.0 must be in [0, 1)"),
        (["data.auto_augment=auto"], "data.auto_augment='auto' is not supported"),
        (
            ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "trainer.label_smoothing=0.1"],
            "are for classification",
        ),
        (
            ["model.init_from=/nonexistent.safetensors"],
            "model.init_from=/nonexistent.safetensors: no such file",
        ),
        (
            ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "parallel=pp2"],
            "pipeline parallelism cuts ViT classifiers into stages",
        ),
        (
            ["model=vit_small", "model.embed_dim=390", "model.mlp_ratio=2.5", "parallel.tp=2"],
            "parallel.tp=2 does not divide the MLP hidden size 975",
        ),
        (
            ["parallel.sequence_parallel=true"],
            "parallel.sequence_parallel=true needs parallel.tp > 1",
        ),
        (["optim.impl=apex"], "optim.impl='apex' is not supported"),
        (["model.sdpa=fast"], "model.sdpa='fast' is not supported"),
        (
            ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "trainer.compile=true"],
            "trainer.compile=true compiles transformer blocks; fasterrcnn_mobilenet_v3 has none",
        ),
        (
            ["parallel=pp2", "parallel.schedule=zero_bubble", "trainer.compile=true"],
            "a compiled block's backward cannot do",
        ),
        (
            ["trainer.compile_autotune=true", "trainer.compile=false"],
            "trainer.compile_autotune=true tunes the compiled kernels: drop trainer.compile=false",
        ),
        (["parallel.checkpoint_blocks=3"], "set parallel.activation_checkpointing=true too"),
        (["data.prefetch_factor=0"], "data.prefetch_factor=0 must be > 0"),
        (["bench.steps=0"], "bench.steps=0 must be > 0"),
        (["bench.variants=[trainer.precision]"], "give key=value overrides separated by spaces"),
        # the fix is the entry's: the run's precision is the rows' too
        (
            ["bench.variants=['trainer.fp8=rowwise']"],
            "bench.variants entry 'trainer.fp8=rowwise': trainer.fp8=rowwise runs the blocks' "
            "linear layers in float8",
        ),
        # a list of overrides is one entry too
        (
            ["bench.variants=[['trainer.fp8=rowwise','model.sdpa=fast']]"],
            "bench.variants entry 'trainer.fp8=rowwise model.sdpa=fast'",
        ),
        (
            ["trainer.max_steps=-1", "trainer.max_epochs=0"],
            "set trainer.max_steps or trainer.max_epochs",
        ),
        (
            ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "model.anchor_scale=0"],
            "model.anchor_scale=0.0 must be > 0",
        ),
        (
            ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "model.roi_sampling_ratio=0"],
            "model.roi_sampling_ratio=0 must be > 0",
        ),
    ],
)
def test_bad_config_has_one_clear_message(overrides, expected):
    message = _error(overrides)
    assert expected in message
    assert "\n" not in message, message


def _plan(overrides, env=None, gpus=0):
    return resolve(load_config(CONFIGS, overrides), env or {}, gpus)[0]


def test_world_size_is_the_product_of_the_mesh():
    assert _plan([]).world_size == 1
    plan = _plan(["parallel.dp=2", "trainer.accelerator=cpu"])
    assert (plan.world_size, plan.dp, plan.accelerator) == (2, 2, "cpu")
    plan = _plan(["parallel.device_memory_gb=80"], gpus=4)  # no GPU here to read its memory from
    assert (plan.accelerator, plan.world_size, plan.dp) == ("cuda", 4, 4)


def test_more_ranks_than_gpus_is_refused():
    with pytest.raises(ConfigError, match="need 8 GPUs but only 2 are visible"):
        _plan(["trainer.devices=8"], gpus=2)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        _plan(["trainer.accelerator=cuda"], gpus=0)


def test_tensor_parallel_world():
    plan = _plan(["model=vit_huge", "parallel=tp4", "trainer.accelerator=cpu"])
    assert (plan.world_size, plan.dp, plan.tp) == (4, 1, 4)  # four gloo processes
    plan = _plan(["model=vit_huge", "parallel=tp4"], gpus=8)
    # every GPU of the node, dp fills the rest
    assert (plan.world_size, plan.dp, plan.tp) == (8, 2, 4)
    with pytest.raises(
        ConfigError,
        match="needs 4 GPUs on this node but only 1 is visible.*trainer.accelerator=cpu",
    ):
        _plan(["model=vit_huge", "parallel=tp4"], gpus=1)
    with pytest.raises(ConfigError, match="tensor-parallel group must sit inside one node"):
        env = {
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "TORCHELASTIC_RUN_ID": "x",
        }
        _plan(["model=vit_huge", "parallel=tp4"], env=env)


def test_torchrun_world_is_checked_against_the_config():
    env = {
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "TORCHELASTIC_RUN_ID": "x",
    }
    plan = _plan([], env=env)
    assert plan.under_torchrun and plan.dp == 4
    with pytest.raises(ConfigError, match="set parallel.dp=4"):
        _plan(["parallel.dp=3"], env=env)


def test_mixup_needs_an_even_micro_batch():
    with pytest.raises(
        ConfigError, match="need an even one, but data.batch_size=18 gives 9 per rank"
    ):
        _plan(["parallel.dp=2", "data.batch_size=18", "data.mixup=0.8"])
    assert _plan(["parallel.dp=2", "data.batch_size=20", "data.cutmix=1.0"]).dp == 2


def test_batch_must_split_over_ranks_and_accumulation():
    with pytest.raises(ConfigError, match=r"use a multiple of 6, e.g. data.batch_size=66"):
        _plan(["parallel.dp=3", "trainer.grad_accum=2", "data.batch_size=64"])


def test_nothing_runs_on_bad_input():
    ran = []
    assert run_tool("train.py", CONFIGS, ["model=vit_small", "parallel.tp=4"], ran.append) == 2
    assert ran == []


def test_validation_is_per_group_and_the_family_decides_what_it_supports():
    """`validate` checks each group on its own; what a model family supports is its ModelSpec's to
    refuse."""
    from visiondist.config import validate
    from visiondist.models.registry import SPECS, check_support
    from visiondist.plan import check

    cfg = compose(CONFIGS, ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "parallel.tp=2"])
    validate(cfg)  # nothing wrong with any group on its own
    with pytest.raises(
        ConfigError, match="tensor parallelism shards ViT blocks; fasterrcnn_mobilenet_v3 has none"
    ):
        check_support(cfg)
    with pytest.raises(ConfigError, match="has none"):
        check(cfg)
    assert {f for f, s in SPECS.items() if "pp" in s.supports} == {"vit"}
    assert {f for f, s in SPECS.items() if "tp" in s.supports} == {"vit", "vitdet"}


def test_the_schema_defaults_are_the_shipped_defaults():
    """A reader who looks a default up in config/schema.py finds the one a run gets: the trainer,
    schedule and optimizer dataclasses' defaults equal their default options' values (the model,
    data and parallel groups have several options, each setting its own; the parallel dataclass is
    the named layouts' baseline, `auto: false`)."""
    from dataclasses import MISSING, fields, is_dataclass

    from visiondist.config import OptimConfig, ScheduleConfig, TrainerConfig, compose

    cfg = compose(REPO / "configs", [])
    differ = []
    for group, schema in (("trainer", TrainerConfig), ("schedule", ScheduleConfig),
                          ("optim", OptimConfig)):  # fmt: skip
        for f in fields(schema):
            default = f.default if f.default_factory is MISSING else f.default_factory()
            if default is MISSING or is_dataclass(default):
                continue
            shipped = OmegaConf.select(cfg, f"{group}.{f.name}", throw_on_missing=False)
            shipped = OmegaConf.to_container(shipped) if OmegaConf.is_config(shipped) else shipped
            if shipped != default:
                differ.append(f"{group}.{f.name}: schema {default!r}, configs {shipped!r}")
    assert not differ, "\n".join(differ)


def test_a_relative_data_root_is_recorded_absolute(tmp_path, monkeypatch):
    """config.yaml records the data.root the run read: a relative one, made absolute, still names
    it when the run is evaluated or continued from another directory. A URL stays as given."""
    for split in ("train", "val"):
        for name in ("a", "b"):
            (tmp_path / "set" / split / name).mkdir(parents=True)
            from PIL import Image

            for i in range(4):
                Image.new("RGB", (8, 8)).save(tmp_path / "set" / split / name / f"{i}.jpg")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(CONFIGS, ["data=imagenet", "data.root=set", "data.batch_size=4"], "train")
    assert cfg.data.root == str(tmp_path / "set")
    url = load_config(
        CONFIGS, ["data=imagenet", "data.format=shards", "data.root=http://127.0.0.1:1/x"], None
    )
    assert url.data.root == "http://127.0.0.1:1/x"


def test_a_setting_newer_than_a_saved_run_is_no_change_at_its_default():
    """A run saved before parallel.gpu existed, continued now: the key at its default is not
    recorded as a change in attempts.jsonl; set to something else, it is."""
    from visiondist.runs import changed_keys

    now = compose(REPO / "configs", [])
    saved = OmegaConf.create(OmegaConf.to_container(now, resolve=True))
    del saved.parallel["gpu"]
    assert changed_keys(saved, now) == []
    now.parallel.gpu = "h100"
    now.optim.lr = 1e-3
    assert changed_keys(saved, now) == ["optim.lr", "parallel.gpu"]


@pytest.mark.parametrize(
    "n, phrase, said",
    [
        (1, "images without labels", "1 image without labels"),
        (2, "images without labels", "2 images without labels"),
        (1, "boxes", "1 box"),
        (1, "classes", "1 class"),
        (1, "label files without an image", "1 label file without an image"),
        (0, "crowd boxes", "0 crowd boxes"),
        (1, "crowd boxes", "1 crowd box"),
    ],
)
def test_counts_in_words(n, phrase, said):
    from visiondist.utils.text import counted

    assert counted(n, phrase) == said
