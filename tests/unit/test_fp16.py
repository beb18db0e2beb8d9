"""`trainer.precision=16` in one process: accepted spellings, the scaler's one skip-or-step decision
for the job, and FSDP2 gradients unscaled. Against fp32 under every layout:
tests/multirank/test_fp16.py."""

import pytest
import torch
from helpers import REPO

INIT_SCALE = 2.0**16  # torch.amp.GradScaler's default, which trainer.precision=16 keeps


@pytest.mark.parametrize("value", ["16", "'16'"], ids=["int", "string"])
def test_precision_16_is_accepted_as_int_or_string(value):
    from visiondist.cli import load_config
    from visiondist.engine.precision import autocast_dtype

    cfg = load_config(REPO / "configs", [f"trainer.precision={value}"], inputs=None)
    assert cfg.trainer.precision == "16" and autocast_dtype(cfg.trainer.precision) == torch.float16
    assert autocast_dtype(16) == torch.float16 and autocast_dtype(32) is None
    assert autocast_dtype("bf16") == torch.bfloat16


@pytest.mark.parametrize(
    "spelling, value", [("fp32", "32"), ("32", "32"), ("fp16", "16"), ("bf16", "bf16")]
)
def test_the_spellings_the_summary_prints_are_taken(spelling, value):
    from visiondist.cli import load_config

    assert (
        load_config(
            REPO / "configs", [f"trainer.precision={spelling}"], inputs=None
        ).trainer.precision
        == value
    )


def test_other_precisions_are_refused_with_the_choices():
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"trainer.precision='half' is not supported: use one of 32 \(or fp32\), "
        r"bf16, 16 \(or fp16",
    ):
        load_config(REPO / "configs", ["trainer.precision=half"], inputs=None)


def test_bf16_on_a_cpu_without_bf16_instructions_says_so_before_training(monkeypatch, caplog):
    """The DeiT recipe sets bf16: where the CPU emulates bf16 (a ViT-Ti step over 8x fp32), the
    start-up names trainer.precision=32; where it has AVX512-BF16 or AMX, nothing is said."""
    import logging
    from types import SimpleNamespace

    from visiondist.cli import load_config
    from visiondist.engine import announce

    cfg = load_config(
        REPO / "configs", ["trainer.precision=bf16", "trainer.max_steps=4"], inputs=None
    )
    layout = SimpleNamespace(device=torch.device("cpu"), is_main=True, world_size=1, run=None)
    sampler = SimpleNamespace(micro_batch=8, dropped_per_epoch=0, groups=None)
    parts = SimpleNamespace(
        data=SimpleNamespace(train_sampler=sampler),
        num_params=5e6,
        rank_params=5e6,
        total_steps=4,
        length="4 steps",
        pipeline=None,
        model=torch.nn.Linear(2, 2),
    )
    trainer = SimpleNamespace(cfg=cfg, layout=layout, parts=parts, run_dir=REPO / "outputs" / "r")
    for has_bf16, said in ((False, True), (True, False)):
        monkeypatch.setattr(announce, "cpu_has_bf16", lambda has_bf16=has_bf16: has_bf16)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=announce.log.name):
            announce.announce(trainer)
        assert any("use trainer.precision=32" in r.message for r in caplog.records) == said, (
            caplog.text
        )


def _model_and_optimizer(fused: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)


def _scaled_step(scaler, model, optimizer, verdict: float) -> None:
    """One step as the Trainer takes it, with the job's verdict `verdict` whatever this rank's
    gradients say."""
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, 4)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.agree(optimizer, torch.tensor(verdict))
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.smoke
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_the_scaler_skips_and_backs_off_on_the_jobs_verdict_not_the_ranks(fused):
    """The rank's own gradients are finite throughout: only `agree` can make it skip. The fused
    optimizer skips on the device (torch hands it the flag), the others after reading it. Growth
    after `growth_interval` finite steps."""
    from visiondist.engine.precision import LossScaler

    model, optimizer = _model_and_optimizer(fused)
    scaler = LossScaler(torch.device("cpu"), growth_interval=2)
    _scaled_step(scaler, model, optimizer, 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    _scaled_step(scaler, model, optimizer, 1.0)  # another rank overflowed
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert {float(s["step"]) for s in optimizer.state.values()} == {1.0}
    assert (
        scaler.state_dict()["scale"] == INIT_SCALE / 2
        and scaler.state_dict()["_growth_tracker"] == 0
    )
    for _ in range(2):
        _scaled_step(scaler, model, optimizer, 0.0)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert {float(s["step"]) for s in optimizer.state.values()} == {3.0}
    assert (
        scaler.state_dict()["scale"] == INIT_SCALE and scaler.state_dict()["_growth_tracker"] == 0
    )


@pytest.mark.smoke
def test_the_scaler_unscales_fsdp2_gradients():
    """FSDP2's gradients are DTensor shards (here over one rank): GradScaler unscales them in
    place."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from visiondist.engine.precision import LossScaler

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, _ = _model_and_optimizer()
        reference = [p.detach().clone() for p in model.parameters()]
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = LossScaler(torch.device("cpu"))
        x = torch.randn(8, 4)
        scaler.scale(model(x).square().mean()).backward()
        scaler.unscale_(optimizer)
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        with torch.no_grad():
            for p, r in zip(plain.parameters(), reference):
                p.copy_(r)
        plain(x).square().mean().backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()
