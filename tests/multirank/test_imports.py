"""What a process imports: the launching process only what it plans with; a model what it declares
to `visiondist.parallel`. (Fresh interpreters: what an earlier test imported would hide either.)"""

import subprocess
import sys


def test_the_launching_process_imports_only_what_it_plans_with():
    """What tools/train.py imports before its ranks start (the CLI, the planner, the entry point,
    the launcher) leaves out what only ranks use: DTensor and DCP, torchvision, albumentations,
    transformers, matplotlib (about 1 s of each multi-rank launch; they are imported once for all
    ranks, only once the launch is planned and starts them)."""
    heavy = [
        "torch.distributed.tensor",
        "torch.distributed.checkpoint",
        "torchvision",
        "albumentations",
        "transformers",
        "matplotlib",
    ]
    code = (
        "import sys\n"
        "import visiondist.cli, visiondist.plan, visiondist.launch, visiondist.runs\n"
        "from visiondist.engine.run import train, evaluate_checkpoint, RANK_IMPORTS\n"
        "from visiondist.models import TASKS, EVAL_METRICS\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_a_vit_brings_its_parallel_plan_wherever_it_is_made():
    """The ViT's TP plan and blocks are registered with visiondist.parallel by importing the model
    itself, not only through the model builder (tests and users make a `VisionTransformer`
    directly)."""
    code = (
        "from visiondist.models.vit import VisionTransformer\nfrom visiondist.parallel.fsdp "
        "import transformer_blocks\nm = VisionTransformer(img_size=16, patch_size=8, "
        "embed_dim=16, depth=2, num_heads=2, num_classes=3)\nprint(len(transformer_blocks(m)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "2"
