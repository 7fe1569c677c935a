"""Block-sparse DFlash attention over a packed sub-batch: masked tiles are never computed.

Layout (one sub-batch): M blocks of B query rows each, flat (R = M*B rows, no padded anchors),
grouped by sequence and sorted by anchor. Keys are the packed context tokens of the sequences
involved (T of them; sequence n occupies [off_n, off_n + T_n)) followed by the blocks' own R keys.
Block j of sequence n with anchor p_j sees context keys [off_n, off_n + min(p_j, len_n)) -- strictly
before the anchor -- and its own B keys, both ways; nothing else.

`BlockPlan` is built once per sub-batch (host arithmetic on the anchors) and shared by every layer.
Two kernels compute the same thing:
- CPU (and any device without flex): `tiled` -- consecutive blocks of one sequence form a tile that
  attends over just the context range it needs plus its own block keys, with a small boolean mask.
- CUDA: `flex` -- `flex_attention` with a `BlockMask` over 128x128 tiles, compiled once per process
  with dynamic shapes and no duck sizing (`app/model/compiled.py`): one graph for every plan of two or
  more query tiles (one more for single-tile plans). Off CUDA the flex kernel runs eager (tests).
`dense_reference` is the old full masked SDPA, kept for tests and the FLOP count of the old path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

FLEX_TILE = 128  # flex_attention's BlockMask granularity (query and key tiles)
MAX_TILE_ROWS = 256  # a CPU tile holds at most this many query rows
SMALL_TILE_SCORES = 128 * 512  # below this many scores a tile merges freely (call overhead dominates on CPU)
TILE_WASTE = 1.3  # merge the next block while executed/needed scores of the tile stay below this


@dataclass(frozen=True)
class Tile:
    """Query rows [q_lo, q_hi), context keys [c_lo, c_hi), and the mask over [ctx keys, own keys]."""

    q_lo: int
    q_hi: int
    c_lo: int
    c_hi: int
    mask: torch.Tensor | None  # [q_hi-q_lo, (c_hi-c_lo) + (q_hi-q_lo)] bool; None = all visible


@dataclass
class BlockPlan:
    """Which keys every block sees in one packed sub-batch; built once, used by every layer."""

    num_ctx: int  # T: packed context tokens
    block_size: int  # B
    ctx_lo_M: np.ndarray  # first visible context key of each block (= its sequence's offset)
    ctx_hi_M: np.ndarray  # one past the last visible context key (offset + min(anchor, length))
    kernel: str  # "tiled" | "flex" | "dense" | "none" (ranges only)
    tiles: list[Tile] = field(default_factory=list)
    flex_mask: object | None = None  # torch BlockMask on CUDA
    dense_mask: torch.Tensor | None = None  # [R, T+R] for the dense reference

    @property
    def num_blocks(self) -> int:
        return len(self.ctx_lo_M)

    @property
    def num_rows(self) -> int:
        return self.num_blocks * self.block_size


def build_plan(ctx_lo_M, ctx_hi_M, num_ctx: int, block_size: int, device: torch.device,
               kernel: str = "auto") -> BlockPlan:
    """The plan for blocks whose visible context is [ctx_lo, ctx_hi) (host ints, grouped by sequence)."""
    lo = np.asarray(ctx_lo_M, dtype=np.int64)
    hi = np.asarray(ctx_hi_M, dtype=np.int64)
    assert lo.shape == hi.shape and (hi >= lo).all() and (hi <= num_ctx).all(), "context ranges out of bounds"
    if kernel == "auto":
        kernel = "flex" if device.type == "cuda" else "tiled"
    plan = BlockPlan(num_ctx, block_size, lo, hi, kernel)
    if kernel == "tiled":
        plan.tiles = _tiles(lo, hi, block_size, device)
    elif kernel == "flex":
        plan.flex_mask = _flex_block_mask(lo, hi, num_ctx, block_size, device)
    elif kernel == "dense":
        plan.dense_mask = dense_mask(lo, hi, num_ctx, block_size, device)
    elif kernel != "none":  # "none": ranges only, for counting and benches that bring their own kernel
        raise ValueError(f"attention kernel {kernel!r}: use auto | tiled | flex | dense")
    return plan


def _tiles(lo: np.ndarray, hi: np.ndarray, B: int, device) -> list[Tile]:
    """Greedy: extend a tile with the next block of the same sequence while it stays cheap."""
    tiles: list[Tile] = []
    M, j = len(lo), 0
    while j < M:
        end, need = j + 1, int(hi[j] - lo[j] + B) * B
        while end < M and lo[end] == lo[j] and (end + 1 - j) * B <= MAX_TILE_ROWS:
            need_new = need + int(hi[end] - lo[end] + B) * B
            rows = (end + 1 - j) * B
            exec_new = rows * (int(hi[j:end + 1].max() - lo[j]) + rows)
            if exec_new > SMALL_TILE_SCORES and exec_new > TILE_WASTE * need_new:
                break
            end, need = end + 1, need_new
        tiles.append(_tile(lo, hi, j, end, B, device))
        j = end
    return tiles


def _tile(lo, hi, j0: int, j1: int, B: int, device) -> Tile:
    c_lo, c_hi = int(lo[j0]), int(hi[j0:j1].max())
    G = j1 - j0
    if G == 1 and int(hi[j0]) == c_hi:
        return Tile(j0 * B, j1 * B, c_lo, c_hi, None)
    ctx_vis = torch.arange(c_lo, c_hi)[None, :] < torch.from_numpy(hi[j0:j1]).repeat_interleave(B)[:, None]
    blk = torch.arange(G).repeat_interleave(B)
    own = blk[:, None] == blk[None, :]
    return Tile(j0 * B, j1 * B, c_lo, c_hi, torch.cat([ctx_vis, own], dim=1).to(device))


def dense_mask(lo: np.ndarray, hi: np.ndarray, T: int, B: int, device) -> torch.Tensor:
    """[R, T + R] boolean mask of the whole sub-batch (the reference, and the old path's shape)."""
    lo_R = torch.from_numpy(lo).repeat_interleave(B)[:, None]
    hi_R = torch.from_numpy(hi).repeat_interleave(B)[:, None]
    kv = torch.arange(T)[None, :]
    blk = torch.arange(len(lo)).repeat_interleave(B)
    return torch.cat([(kv >= lo_R) & (kv < hi_R), blk[:, None] == blk[None, :]], dim=1).to(device)


def _flex_block_mask(lo: np.ndarray, hi: np.ndarray, T: int, B: int, device):
    """The BlockMask built from the host ranges: no mask evaluation over the [R, T+R] grid and no
    compile per sub-batch shape. Tiles every pair of which is visible are `full` (no mask_mod)."""
    from torch.nn.attention.flex_attention import BlockMask

    R = len(lo) * B
    partial, full = _flex_tile_lists(lo, hi, T, B)
    kv_tiles = -(-(T + R) // FLEX_TILE)  # torch wants the index rows as wide as the key tiles
    kv_num, kv_idx = _pad_lists(partial, kv_tiles)
    full_num, full_idx = _pad_lists(full, kv_tiles)
    lo_M, hi_M, kv_num, kv_idx, full_num, full_idx = int32_to_device([lo, hi, kv_num, kv_idx, full_num, full_idx],
                                                                     device)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // B
        in_ctx = (kv_idx >= lo_M[blk]) & (kv_idx < hi_M[blk])
        own = (kv_idx >= T) & ((kv_idx - T) // B == blk)
        return in_ctx | own

    return BlockMask.from_kv_blocks(kv_num[None, None], kv_idx[None, None], full_num[None, None],
                                    full_idx[None, None], BLOCK_SIZE=FLEX_TILE, mask_mod=mask_mod,
                                    seq_lengths=(R, T + R))


def int32_to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host integer arrays as int32 tensors on `device`: packed into one pinned buffer (on CUDA) and
    copied in one non-blocking transfer, instead of one blocking copy each (six per sub-batch)."""
    sizes = [int(a.size) for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int32, pin_memory=device.type == "cuda")
    np.concatenate([np.asarray(a).reshape(-1) for a in arrays], out=host.numpy(), casting="unsafe")
    # The caching host allocator keeps the pinned buffer until the copy has run, so it may go out of scope.
    flat = host.to(device, non_blocking=True)
    return [t.view(np.shape(a)) for t, a in zip(flat.split(sizes), arrays)]


def _flex_tile_lists(lo: np.ndarray, hi: np.ndarray, T: int, B: int, tile: int = FLEX_TILE):
    """Per query tile: (partial key tiles, full key tiles), each sorted; host arithmetic only."""
    R = len(lo) * B
    partial, full = [], []
    for q0 in range(0, R, tile):
        j0, j1 = q0 // B, min(len(lo), -(-(q0 + tile) // B))
        rows_in_tile = min(tile, R - q0)
        kv: set[int] = set()
        for j in range(j0, j1):
            if hi[j] > lo[j]:
                kv.update(range(int(lo[j]) // tile, (int(hi[j]) - 1) // tile + 1))
            kv.update(range((T + j * B) // tile, (T + j * B + B - 1) // tile + 1))
        # A key tile is full when it lies in the context and inside every row's visible range.
        lo_min, hi_min = int(lo[j0:j1].max()), int(hi[j0:j1].min())
        whole = rows_in_tile == tile and (j1 - j0) * B == tile and q0 == j0 * B
        f = sorted(k for k in kv if whole and (k + 1) * tile <= T and k * tile >= lo_min and (k + 1) * tile <= hi_min)
        full.append(f)
        partial.append(sorted(kv.difference(f)))
    return partial, full


def _pad_lists(lists: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.zeros((len(lists), width), dtype=np.int32)
    for i, x in enumerate(lists):
        idx[i, :len(x)] = x
    return np.array([len(x) for x in lists], dtype=np.int32), idx


_FLEX_COMPILED: dict = {}


def compiled_flex(backend="inductor"):
    """flex_attention compiled once per process and backend (dynamic shapes, no duck sizing)."""
    from torch.nn.attention.flex_attention import flex_attention

    from app.model.compiled import compile_dynamic

    if backend not in _FLEX_COMPILED:
        _FLEX_COMPILED[backend] = compile_dynamic(flex_attention, backend)
    return _FLEX_COMPILED[backend]


def _flex_fn(device: torch.device):
    """The compiled flex on CUDA; eager flex elsewhere (a slow reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    return compiled_flex() if device.type == "cuda" else flex_attention


def block_attention(q_hRd: torch.Tensor, k_hKd: torch.Tensor, v_hKd: torch.Tensor, plan: BlockPlan,
                    scale: float) -> torch.Tensor:
    """Attention output [heads, R, d]; q has `heads` heads, k/v have kv heads (GQA, grouped)."""
    if plan.kernel == "flex":
        out = _flex_fn(q_hRd.device)(q_hRd[None], k_hKd[None], v_hKd[None], block_mask=plan.flex_mask,
                                     scale=scale, enable_gqa=q_hRd.shape[0] != k_hKd.shape[0])
        return out[0]
    if plan.kernel == "dense":
        return _sdpa(q_hRd, k_hKd, v_hKd, plan.dense_mask, scale)
    T = plan.num_ctx
    outs = []
    for t in plan.tiles:
        k = torch.cat([k_hKd[:, t.c_lo:t.c_hi], k_hKd[:, T + t.q_lo:T + t.q_hi]], dim=1)
        v = torch.cat([v_hKd[:, t.c_lo:t.c_hi], v_hKd[:, T + t.q_lo:T + t.q_hi]], dim=1)
        outs.append(_sdpa(q_hRd[:, t.q_lo:t.q_hi], k, v, t.mask, scale))
    return torch.cat(outs, dim=1)


def _sdpa(q, k, v, mask, scale):
    gqa = q.shape[0] != k.shape[0]
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Pinned: a silent fallback to the math kernel would materialise every score; raise instead.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)[0]


def attention_flops(plan_lo: np.ndarray, plan_hi: np.ndarray, T: int, B: int, kernel: str) -> tuple[int, int]:
    """(executed, needed) query-key score pairs per head for one sub-batch (FLOPs = 4 * d * pairs).

    needed = each row against its visible context plus its own block; executed follows the kernel:
    dense = every row against every key; tiled = the tiles' rows x keys; flex = 128x128 tiles that
    hold at least one visible pair, computed in full.
    """
    lo, hi = np.asarray(plan_lo, np.int64), np.asarray(plan_hi, np.int64)
    R = len(lo) * B
    needed = int(((hi - lo) + B).sum()) * B
    if kernel == "dense":
        return R * (T + R), needed
    if kernel == "tiled":
        tiles = _tiles(lo, hi, B, torch.device("cpu"))
        return sum((t.q_hi - t.q_lo) * (t.c_hi - t.c_lo + t.q_hi - t.q_lo) for t in tiles), needed
    if kernel == "flex":
        return flex_tiles(lo, hi, T, B) * FLEX_TILE * FLEX_TILE, needed
    raise ValueError(kernel)


def flex_tiles(lo: np.ndarray, hi: np.ndarray, T: int, B: int, tile: int = FLEX_TILE) -> int:
    """Non-empty (query tile, key tile) pairs of the flex BlockMask (partial + full), on the host."""
    partial, full = _flex_tile_lists(np.asarray(lo), np.asarray(hi), T, B, tile)
    return sum(len(p) + len(f) for p, f in zip(partial, full))
