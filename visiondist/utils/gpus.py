"""GPU boards by name: their memory and datasheet peaks. torch-free (the planner reads it).

`parallel.gpu=a100-40gb` plans for a board this machine does not have (`tools/plan.py` on a login
node); on a GPU, `torch.cuda.get_device_name()` finds its board here by pattern, for the MFU
denominators (`utils/peaks.py`) and the time model's rate.

Sources. Peaks are dense (no 2:4 sparsity) TFLOP/s as (fp32 without tensor cores, tf32, bf16, fp16):
NVIDIA's tables list the tensor-core rates with sparsity, dense is half.
- H100 SXM and PCIe: the H100 datasheet (SXM 67 / 989* / 1979* / 1979*, PCIe 51 / 756* / 1513* /
  1513*, "* with sparsity, 1/2 lower without"); the SXM dense figures to one decimal (66.9, 494.7,
  989.4) from the Hopper whitepaper.
- H100 NVL, H200 NVL (60 / 835* / 1671* / 1671*) and H200 SXM (67 / 989* / 1979* / 1979*): NVIDIA's
  H100 and H200 product pages; the same Hopper die at other clocks and power.
- A100 SXM4 and PCIe, 40 and 80 GB (19.5 / 156 / 312 / 312): the A100 datasheet.
- L40S (91.6 / 183 / 362.05 / 362.05), A10 (31.2 / 62.5 / 125 / 125) and L4 (30.3 / 60 / 121 /
  121): their datasheets. The AWS A10G is another board and is not listed.
Memory is the board's as sold, in GB (an H100's "80 GB"; torch reads about 85e9 bytes of it): the
planner's budget is a fraction of it (parallel.headroom). The link between a node's GPUs, per
device and direction, as the time model takes it (parallel.intra_node_gbs): NVLink boards (SXM)
300 GB/s, the default; PCIe boards what their slot sustains, about 25 GB/s on PCIe 4 (A100 PCIe,
L40S, A10, L4) and 50 on PCIe 5 (H100 PCIe and NVL, whose NVLink bridge joins pairs only, H200 NVL).
The sustained rate is one share of the datasheet's for every board: a board with less memory
bandwidth per FLOP than an H100 (the L40S) reaches less; give parallel.device_tflops from a
measurement (tools/benchmark.py) there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The time model's sustained dense bf16 rate as a share of the datasheet's: 400 TFLOP/s on an H100
# (parallel.device_tflops' figure for it). It ranks layouts against each other; no wall time is
# predicted from it.
SUSTAINED_SHARE = 400.0 / 989.4


@dataclass(frozen=True)
class Board:
    key: str  # parallel.gpu=<key>
    pattern: str  # matches torch.cuda.get_device_name() (the first board that matches wins)
    memory_gb: float
    fp32: float
    tf32: float
    bf16: float
    fp16: float
    link_gbs: float = 300.0  # to the node's other GPUs, per device and direction (NVLink: 300)

    def peak(self, kind: str) -> float:
        """The datasheet's dense peak in `kind` ("fp32", "tf32", "bf16" or "fp16")."""
        return float(getattr(self, kind))

    @property
    def sustained_tflops(self) -> float:
        """The time model's rate for this board (parallel.device_tflops)."""
        return round(self.bf16 * SUSTAINED_SHARE, 1)


# NVL and PCIe boards come before their plain name: an H100 SXM reports "NVIDIA H100 80GB HBM3"
BOARDS: tuple[Board, ...] = (
    Board("h100-nvl", r"\bH100\b.*\bNVL\b", 94.0, 60.0, 417.5, 835.5, 835.5, 50.0),
    Board("h100-pcie", r"\bH100\b.*\bPCIe\b", 80.0, 51.0, 378.0, 756.5, 756.5, 50.0),
    Board("h100", r"\bH100\b", 80.0, 66.9, 494.7, 989.4, 989.4),
    Board("h200-nvl", r"\bH200\b.*\bNVL\b", 141.0, 60.0, 417.5, 835.5, 835.5, 50.0),
    Board("h200", r"\bH200\b", 141.0, 66.9, 494.7, 989.4, 989.4),
    Board("a100-pcie-40gb", r"\bA100\b.*\bPCIe\b.*\b40GB\b", 40.0, 19.5, 156.0, 312.0, 312.0, 25.0),
    Board("a100-pcie-80gb", r"\bA100\b.*\bPCIe\b", 80.0, 19.5, 156.0, 312.0, 312.0, 25.0),
    Board("a100-40gb", r"\bA100\b.*\b40GB\b", 40.0, 19.5, 156.0, 312.0, 312.0),
    Board("a100-80gb", r"\bA100\b", 80.0, 19.5, 156.0, 312.0, 312.0),
    Board("l40s", r"\bL40S\b", 48.0, 91.6, 183.0, 362.05, 362.05, 25.0),
    Board("a10", r"\bA10\b", 24.0, 31.2, 62.5, 125.0, 125.0, 25.0),
    Board("l4", r"\bL4\b", 24.0, 30.3, 60.0, 121.0, 121.0, 25.0),
)
# other names for a board: what people call it, and nvidia-smi's names (board_of_device reads those)
ALIASES = {
    "h100-sxm": "h100",
    "h100-80gb": "h100",
    "h200-sxm": "h200",
    "a100-sxm-40gb": "a100-40gb",
    "a100-sxm-80gb": "a100-80gb",
}


def board_of_device(device_name: str) -> Board | None:
    """The board torch.cuda.get_device_name() names; None for one the table does not know (every
    CPU)."""
    for board in BOARDS:
        if re.search(board.pattern, device_name, flags=re.IGNORECASE):
            return board
    return None


def board_named(key: str) -> Board:
    """The board of `parallel.gpu=<key>` (case and `_` / `-` do not matter; an alias, or the name
    nvidia-smi gives, "NVIDIA H100 80GB HBM3"); ValueError naming the keys for another."""
    want = key.strip().lower().replace("_", "-")
    want = ALIASES.get(want, want)
    for board in BOARDS:
        if board.key == want:
            return board
    if " " in key.strip():  # a device's full name
        found = board_of_device(key)
        if found is not None:
            return found
    if want in ("a100", "a100-sxm", "a100-pcie"):
        raise ValueError(
            f"parallel.gpu={key}: which memory? {want}-40gb or {want.replace('-sxm', '')}-80gb"
        )
    raise ValueError(
        f"parallel.gpu={key} is not a board the planner knows: use one of "
        f"{', '.join(b.key for b in BOARDS)}, or give its memory and rate "
        "(parallel.device_memory_gb=... parallel.device_tflops=..., 0.4 x its dense bf16 peak)"
    )
