"""Activation checkpointing gives the same gradients. FSDP runs against DDP:
tests/multirank/test_fsdp.py."""

import torch


def test_activation_checkpointing_gives_the_same_gradients():
    from visiondist.models.vit import VisionTransformer
    from visiondist.parallel import enable_activation_checkpointing

    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = VisionTransformer(
            img_size=32,
            patch_size=8,
            num_classes=4,
            embed_dim=32,
            depth=3,
            num_heads=2,
            drop_path_rate=0.3,
        )
        if checkpointing:
            assert enable_activation_checkpointing(model) == 3
        torch.manual_seed(1)  # the same drop-path draws; the recompute must replay them
        model(torch.randn(6, 3, 32, 32)).logsumexp(1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-6, atol=1e-7)
