"""Bad input fails before anything starts, with one message that names the fix."""

from helpers import run_cli


def test_cli_exits_2_with_the_message(tmp_path):
    result = run_cli(
        ["model=vit_small", "parallel.tp=4", f"trainer.output_dir={tmp_path}"], timeout=60
    )
    assert result.returncode == 2
    assert "error: parallel.tp=4 does not divide model.num_heads=6" in result.stdout
    assert not any(tmp_path.iterdir())  # no run directory, no rank started
