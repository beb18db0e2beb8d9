"""Vision Transformer in plain PyTorch, numerically identical to timm's `VisionTransformer`.

Differences from timm are deliberate and layout-only: attention keeps separate `q`, `k` and `v`
parameters so a tensor parallel plan can shard them by whole heads (a fused qkv weight cannot be
column-split naively) and runs them as one GEMM as timm does (`Attention`), and the number of heads
a module computes is derived from its weight shape, so a sharded copy runs unchanged.
`to_timm_state_dict` / `from_timm_state_dict` convert to and from timm's keys (fused `qkv`) exactly.

Initialisation is timm's (truncated normal Linear weights, lecun-normal patch embedding, ...), but
each parameter is drawn from a generator of its own (`visiondist.models.init`), so a model built on
the meta device can be laid out first and each rank draw only the tensors it keeps, equal to what
one process draws.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from visiondist.models import vit_parallel
from visiondist.models.init import InitSource, Rule, draw_seed, materialize
from visiondist.models.patches import Patches, native_forward
from visiondist.models.weights import LazyState, check_fits, plan_init_from
from visiondist.utils.pretrained import local_file


class _FusedQKV(torch.autograd.Function):
    """y = x W^T + b with W = [Wq; Wk; Wv], b = [bq; bk; bv] in one GEMM, saving the three weights
    rather than their concatenation: a saved concatenation would hold 3 x dim x dim more per block
    until the backward (in fp32 where autocast is off; under FSDP, a copy of the gathered weights
    FSDP frees after the forward), while the weights are parameters, held anyway. The backward
    concatenates them again (a copy of the weights, not of activations). Under autocast the GEMM
    runs in its dtype as any linear layer's does, and x is saved in that dtype: one 16-bit copy, as
    autocast's linear saves."""

    @staticmethod
    def forward(ctx, x, wq, wk, wv, bq, bk, bv):
        bias = None if bq is None else torch.cat([bq, bk, bv])
        out = F.linear(x, torch.cat([wq, wk, wv]), bias)
        # autocast's cast of x (the same values its linear multiplied); x itself without it
        xc = x.to(out.dtype)
        ctx.save_for_backward(xc, wq, wk, wv)
        ctx.x_dtype, ctx.has_bias = x.dtype, bq is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        xc, wq, wk, wv = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ torch.cat([wq, wk, wv]).to(grad.dtype)).to(ctx.x_dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        if any(ctx.needs_input_grad[1:4]):
            grad_w = (rows.t() @ xc.reshape(-1, xc.shape[-1]).to(grad.dtype)).to(wq.dtype).chunk(3)
        if ctx.has_bias and any(ctx.needs_input_grad[4:7]):
            grad_b = rows.sum(0, dtype=torch.float32).to(wq.dtype).chunk(3)
        return (grad_x, *(grad_w or (None,) * 3), *(grad_b or (None,) * 3))


class Attention(nn.Module):
    """Self-attention with `q`, `k` and `v` kept as three `Linear` modules (the tensor-parallel plan
    splits each by whole heads, and checkpoints name them apart) but run as one GEMM, as timm's
    fused `qkv`: the three weights are concatenated in the forward (rows q, k, v; under tensor
    parallelism each holds this rank's heads, so the concatenation is this rank's fused qkv) by
    `_FusedQKV`, which saves the weights and not their concatenation. On an H100 the three GEMMs
    cost ViT-S/16 2.3% more GPU time a step and 252 more kernel launches (benchmarks/ RESULTS.md).
    `fuse_qkv = False` runs the three projections apart; projections that are not plain `Linear`
    (float8's) always run apart."""

    fuse_qkv = True

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: None (every token sees every token) or a boolean (B, 1, N or 1, N) of the pairs
        that attend (native-resolution sequences: `visiondist.models.patches`)."""
        b, n, _ = x.shape
        q, k, v = self.q, self.k, self.v
        # (B, N, H*hd) -> (B, H, N, hd); H is whatever this (possibly sharded) projection holds.
        if self.fuse_qkv and type(q) is nn.Linear and type(k) is nn.Linear and type(v) is nn.Linear:
            if torch.is_grad_enabled() and not torch.jit.is_tracing():
                qkv = _FusedQKV.apply(x, q.weight, k.weight, v.weight, q.bias, k.bias, v.bias)
            # inference and export (TorchScript cannot hold a Python autograd function): nothing is
            # saved
            else:
                bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
                qkv = F.linear(x, torch.cat([q.weight, k.weight, v.weight]), bias)
            q, k, v = qkv.view(b, n, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (p(x).view(b, n, -1, self.head_dim).transpose(1, 2) for p in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample.

    The keep probability is a (non-persistent) buffer, not a Python float: every block has its own
    rate, and torch.compile specialises on float attributes, so a float would compile one graph per
    block and hit dynamo's recompile limit (8) in deep models. With the buffer all blocks share one
    graph (two: with and without drop)."""

    keep_prob: torch.Tensor  # the buffer

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.active = p > 0.0
        self.register_buffer("keep_prob", torch.tensor(1.0 - p), persistent=False)

    def reset_buffers(self) -> None:
        """The buffer again from the rate (after the module's tensors were allocated anew, e.g. off
        the meta device)."""
        with torch.no_grad():
            self.keep_prob.fill_(1.0 - self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active or not self.training:
            return x
        keep_prob = self.keep_prob.to(x.dtype)
        keep = torch.bernoulli(keep_prob.expand((x.shape[0],) + (1,) * (x.ndim - 1)))
        return x * keep / keep_prob


class Block(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, drop_path: float
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.drop_path = DropPath(drop_path)
        # keep only the input for the backward and recompute the rest there
        self.checkpointing = False
        # () -> (forward context, recomputation context), torch's `context_fn`
        self.recompute_context: Optional[Callable[[], Any]] = None
        # more keyword arguments of torch's checkpoint (the dry run's)
        self.checkpoint_options: dict = {}

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # non-reentrant: RNG (drop path) replayed, kwargs-safe
        if self.checkpointing and torch.is_grad_enabled():
            context: dict[str, Any] = (
                {"context_fn": self.recompute_context} if self.recompute_context is not None else {}
            )
            return torch.utils.checkpoint.checkpoint(
                self._forward, x, mask, use_reentrant=False, **context, **self.checkpoint_options
            )
        return self._forward(x, mask)

    def _forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop_path(
            self.attn(self.norm1(x), mask) if mask is not None else self.attn(self.norm1(x))
        )
        return x + self.drop_path(self.mlp(self.norm2(x)))


class Blocks(nn.Sequential):
    """The transformer blocks in order; an attention mask (native-resolution sequences) goes to
    each. One module, so that the sequence-parallel region (`visiondist.models.vit_parallel`) wraps
    all of them either way."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self:
            x = block(x) if mask is None else block(x, mask)
        return x


class PatchEmbed(nn.Module):
    """The patch embedding: timm's `Conv2d` (kernel = stride = patch; its weight and keys, so
    exports load unchanged), run as the GEMM it is: the image cut into patches (a reshape and one
    transposing copy) times the flattened weight. On an H100 the convolution's cuDNN kernel
    (`implicit_convolve_sgemm`) took 1.65 ms of a 32 ms ViT-S/16 step at batch 256; the GEMM does
    the same products in a fraction of that (benchmarks/RESULTS.md)."""

    def __init__(self, img_size: int, patch_size: int, dim: int):
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(
                f"expected {self.img_size}x{self.img_size} images, got {tuple(x.shape[-2:])}"
            )
        p = self.patch_size
        # the convolution's stride leaves the last pixels out
        if x.shape[-2] % p or x.shape[-1] % p:
            x = x[..., : x.shape[-2] - x.shape[-2] % p, : x.shape[-1] - x.shape[-1] % p]
        b, c, h, w = x.shape
        # (B, C, H, W) -> (B, H/p * W/p, C * p * p): each row one patch, its values ordered as the
        # kernel's (c, i, j)
        patches = (
            x.view(b, c, h // p, p, w // p, p)
            .permute(0, 2, 4, 1, 3, 5)
            .reshape(b, (h // p) * (w // p), -1)
        )
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


class VisionTransformer(nn.Module):
    """ViT with a class token and a learned position embedding; classifies from the class token."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        # first: the weights depend on the global generator's state alone
        self.init_seed = draw_seed()
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        device = torch.get_default_device()
        # shapes only; the values are drawn below, or per rank after a layout
        with torch.device("meta"):
            self.patch_embed = PatchEmbed(img_size, patch_size, embed_dim)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
            self.pos_embed = nn.Parameter(
                torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim)
            )
            # linear, as timm
            rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
            self.blocks = Blocks(
                *(Block(embed_dim, num_heads, mlp_ratio, qkv_bias, r) for r in rates)
            )
            self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
            self.head_drop = nn.Dropout(drop_rate)
            self.head = nn.Linear(embed_dim, num_classes)
        # built under `torch.device("meta")`: stays there (see models.init)
        if device.type != "meta":
            materialize(self, device, InitSource(self))

    def init_rules(self) -> dict[str, Rule]:
        """Parameter name -> how its full value is drawn: timm's init for Linear layers and
        embeddings, the patch embedding lecun-normal as in the JAX reference."""

        def trunc_normal(std: float) -> Rule:
            return lambda t, g: nn.init.trunc_normal_(t, std=std, generator=g)

        def constant(value: float) -> Rule:
            return lambda t, g: nn.init.constant_(t, value)

        rules: dict[str, Rule] = {
            "pos_embed": trunc_normal(0.02),
            "cls_token": lambda t, g: nn.init.normal_(t, std=1e-6, generator=g),
        }
        for path, module in self.named_modules():
            prefix = f"{path}." if path else ""
            if isinstance(module, nn.Linear):
                rules[prefix + "weight"] = trunc_normal(0.02)
                if module.bias is not None:
                    rules[prefix + "bias"] = constant(0.0)
            elif isinstance(module, nn.LayerNorm):
                rules[prefix + "weight"], rules[prefix + "bias"] = constant(1.0), constant(0.0)
        w = self.patch_embed.proj.weight
        rules["patch_embed.proj.weight"] = trunc_normal(math.sqrt(1.0 / w[0].numel()))
        rules["patch_embed.proj.bias"] = constant(0.0)
        return rules

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every parameter anew (a new seed from the global generator)."""
        self.init_seed = draw_seed()
        source = InitSource(self)
        for name, param in self.named_parameters():
            param.copy_(source(name))

    @staticmethod
    def no_weight_decay() -> set[str]:
        return {"pos_embed", "cls_token"}

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_drop(self.norm(x)[:, 0]))

    def forward(self, x: torch.Tensor | Patches) -> torch.Tensor:
        """Logits of a batch of square images (B, 3, img_size, img_size), or of the images in a
        batch of native-resolution patch sequences (`visiondist.models.patches.Patches`), in the
        batch's image order."""
        if isinstance(x, Patches):
            return native_forward(self, x)
        return self.forward_head(self.blocks(self.embed(x)))


# --------------------------------------------------------------------------------------------------
# timm key layout: identical except attention's fused qkv (rows ordered q, k, v).

_QKV = ("q", "k", "v")


def to_timm_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our canonical state dict -> timm `VisionTransformer` keys (q/k/v fused into `attn.qkv`)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        parts = key.rsplit(".", 2)  # e.g. blocks.3.attn . q . weight
        if len(parts) == 3 and parts[1] in _QKV and parts[0].endswith(".attn"):
            if parts[1] == "q":
                prefix, kind = parts[0], parts[2]
                out[f"{prefix}.qkv.{kind}"] = torch.cat(
                    [state[f"{prefix}.{n}.{kind}"] for n in _QKV], dim=0
                )
            continue
        out[key] = value
    return out


def from_timm_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm `VisionTransformer` keys -> ours (`attn.qkv` split into q, k, v)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        parts = key.rsplit(".", 2)
        if len(parts) == 3 and parts[1] == "qkv" and parts[0].endswith(".attn"):
            for name, chunk in zip(_QKV, value.chunk(3, dim=0)):
                out[f"{parts[0]}.{name}.{parts[2]}"] = chunk.clone()
            continue
        out[key] = value
    return out


_FUSED = re.compile(r"^(.*\.attn)\.qkv\.(weight|bias)$")


class SplitFusedQKV(Mapping):
    """timm-layout weights seen under our keys, read lazily: `blocks.<i>.attn.q.weight` is the first
    third of timm's `blocks.<i>.attn.qkv.weight` (rows ordered q, k, v), read when asked for; every
    other key passes through."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = state
        self._parts: dict[str, tuple[str, int]] = {}
        for key in state:
            match = _FUSED.match(key)
            if match:
                for i, name in enumerate(_QKV):
                    self._parts[f"{match.group(1)}.{name}.{match.group(2)}"] = (key, i)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._parts:
            fused, i = self._parts[key]
            return self.state[fused].chunk(3, dim=0)[i].clone()
        if _FUSED.match(key):
            raise KeyError(key)
        return self.state[key]

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self.state if not _FUSED.match(k))
        yield from self._parts

    def __len__(self) -> int:
        return sum(1 for _ in self)


def init_source(cfg, model: VisionTransformer) -> InitSource:
    """Where the (meta) model's initial values come from: `model.weights` (exactly these tensors),
    `model.init_from` (fine-tuning: a new head when the class count differs, the position embedding
    resampled), or the init rules. Weights in timm's layout (fused `qkv`) are read as ours."""

    def ours(weights):
        return SplitFusedQKV(weights) if any(_FUSED.match(k) for k in weights) else weights

    own = model.state_dict()
    if cfg.weights:
        state = ours(LazyState(cfg.weights, "model.weights"))
        check_fits(state, own, "model.weights", cfg.weights, type(model).__name__)
        return InitSource(model, state)
    if cfg.get("init_from"):
        # a timm name: its file in the Hugging Face cache
        file = str(local_file(cfg.init_from, "model.init_from"))
        state, fresh = plan_init_from(
            ours(LazyState(file, "model.init_from")), own, cfg.init_from, type(model).__name__
        )
        return InitSource(model, state, tuple(fresh))
    return InitSource(model)


# What the ViT declares to `visiondist.parallel` (its TP plan, its block, its stage cut) comes with
# the model wherever it is made.
vit_parallel.declare(VisionTransformer, Block)
