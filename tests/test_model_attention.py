"""Block-sparse drafter attention: tiled (CPU) and flex kernels against the dense masked reference."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from app.model.attention import attention_flops, block_attention, build_plan, flex_tiles
from app.model.packing import pack_blocks, split_rows

CPU = torch.device("cpu")


def _ranges(seed=0, B=4, seqs=((40, 9), (23, 5), (70, 14))):
    """(lo, hi, T): blocks of a few sequences, anchors sorted, as `pack_blocks` lays them out."""
    rng = np.random.default_rng(seed)
    seq, anchors, lengths = [], [], []
    for n, (length, count) in enumerate(seqs):
        a = np.sort(rng.choice(np.arange(length - B + 1), size=count, replace=False))
        seq += [n] * count
        anchors += a.tolist()
        lengths.append(length)
    sub = pack_blocks(np.array(seq), np.array(anchors), np.array(lengths), max(lengths), B, CPU, "dense")
    return sub.plan.ctx_lo_M, sub.plan.ctx_hi_M, sub.plan.num_ctx


def _qkv(R, T, heads=4, kv_heads=2, d=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, R, d, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(kv_heads, T + R, d, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(kv_heads, T + R, d, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v


def _run(kernel, lo, hi, T, B, q, k, v):
    plan = build_plan(lo, hi, T, B, CPU, kernel)
    out = block_attention(q, k, v, plan, scale=0.35)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out, grads, plan


def test_tiled_equals_dense_masked_reference_outputs_and_gradients():
    B = 4
    lo, hi, T = _ranges(B=B)
    q, k, v = _qkv(len(lo) * B, T)
    ref, ref_g, _ = _run("dense", lo, hi, T, B, q, k, v)
    out, g, plan = _run("tiled", lo, hi, T, B, q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert len(plan.tiles) > 1  # really tiled, not one dense call
    executed, needed = attention_flops(lo, hi, T, B, "tiled")
    dense, _ = attention_flops(lo, hi, T, B, "dense")
    assert needed <= executed < dense


def test_dense_reference_hides_the_anchor_and_other_blocks():
    # The reference itself encodes the rules the tiles must match: `<` the anchor, own block only.
    lo, hi = np.array([0, 0]), np.array([3, 6])
    from app.model.attention import dense_mask

    m = dense_mask(lo, hi, 6, 2, CPU)
    assert m[0, :6].tolist() == [True, True, True, False, False, False]  # anchor 3 unseen
    assert m[2, :6].tolist() == [True] * 6
    assert m[0, 6:].tolist() == [True, True, False, False] and m[3, 6:].tolist() == [False, False, True, True]


def _tile_sets(bm):
    """Per query tile: (all non-empty key tiles, full key tiles) of a BlockMask."""
    def rows(num, idx):
        if num is None:
            return [set() for _ in range(bm.kv_num_blocks.shape[-1])]
        return [set(idx[0, 0, i, :int(num[0, 0, i])].tolist()) for i in range(num.shape[-1])]
    part, full = rows(bm.kv_num_blocks, bm.kv_indices), rows(bm.full_kv_num_blocks, bm.full_kv_indices)
    return [p | f for p, f in zip(part, full)], full


def test_flex_forward_equals_dense_on_cpu_and_host_block_mask_equals_torchs():
    # flex has no backward on CPU; its forward (eager) and its BlockMask still run here.
    from torch.nn.attention.flex_attention import create_block_mask

    B = 16
    lo, hi, T = _ranges(B=B, seqs=((300, 20), (150, 9), (700, 24)))
    # The flex layout: context aligned to the tile, so some key tiles are full.
    sub = pack_blocks(np.repeat([0, 1, 2], [20, 9, 24]), np.concatenate([np.sort(np.random.default_rng(0).choice(
        np.arange(a, L - B), n, replace=False)) for a, L, n in ((2, 300, 20), (2, 150, 9), (2, 700, 24))]),
        np.array([300, 150, 700]), 700, B, CPU, "none", align=128)
    for lo, hi, T in ((lo, hi, T), (sub.plan.ctx_lo_M, sub.plan.ctx_hi_M, sub.plan.num_ctx)):
        q, k, v = _qkv(len(lo) * B, T, d=16)
        q, k, v = (t.detach().float() for t in (q, k, v))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dense = block_attention(q, k, v, build_plan(lo, hi, T, B, CPU, "dense"), 0.25)
            plan = build_plan(lo, hi, T, B, CPU, "flex")
            flex = block_attention(q, k, v, plan, 0.25)
        torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)
        m = plan.flex_mask.mask_mod
        ref = create_block_mask(m, None, None, len(lo) * B, T + len(lo) * B, device="cpu", BLOCK_SIZE=128)
        ours_all, ours_full = _tile_sets(plan.flex_mask)
        ref_all, ref_full = _tile_sets(ref)
        assert ours_all == ref_all  # the same tiles computed as torch's own grid evaluation
        assert all(o <= r for o, r in zip(ours_full, ref_full))  # full only where torch agrees
        assert flex_tiles(lo, hi, T, B) == sum(len(x) for x in ref_all)
    assert sum(len(x) for x in ours_full) > 0


def test_split_rows_bounds_every_sub_batch():
    parts = split_rows(10, 16, 50)  # 3 blocks of 16 rows fit in 50
    assert [p.stop - p.start for p in parts] == [3, 3, 3, 1]
    assert split_rows(10, 16, 0) == [slice(0, 10)]
    assert split_rows(3, 16, 8) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # at least one block each


def test_pack_blocks_keeps_only_visible_context():
    sub = pack_blocks(np.array([0, 0, 2]), np.array([3, 7, 5]), np.array([12, 9, 4]), 12, 2, CPU)
    # seq 0 needs positions 0..6 (max anchor 7), seq 2 only 0..3 (length 4 < anchor 5).
    assert sub.plan.num_ctx == 7 + 4
    assert sub.ctx_index_T.tolist() == list(range(7)) + [24, 25, 26, 27]
    assert sub.plan.ctx_lo_M.tolist() == [0, 0, 7] and sub.plan.ctx_hi_M.tolist() == [3, 7, 11]
    assert sub.q_pos_R.tolist() == [3, 4, 7, 8, 5, 6]
    assert sub.k_pos_K.tolist() == list(range(7)) + list(range(4)) + [3, 4, 7, 8, 5, 6]


def test_aligned_packing_gives_the_same_drafter_output():
    # The flex layout pads each sequence's context to the tile; padding must stay invisible.
    from app.model.drafter import DFlashDrafter
    from tests.toy import tiny_arch, tiny_qwen3_config

    torch.manual_seed(0)
    arch = tiny_arch(tiny_qwen3_config(), num_layers=2, block_size=4, target_layer_ids=(0, 2))
    d = DFlashDrafter(arch).eval()
    for p in d.parameters():
        p.data.normal_(0, 0.3)
    seq, anchors, lengths, S = np.array([0, 0, 1, 1, 1]), np.array([3, 9, 2, 5, 11]), np.array([16, 15]), 16
    feats = torch.randn(2 * S, arch.feature_dim)
    emb = torch.randn(len(seq) * 4, arch.hidden_size)
    outs = []
    with torch.no_grad():
        for align in (1, 8):
            sub = pack_blocks(seq, anchors, lengths, S, 4, CPU, "tiled", align=align)
            assert sub.plan.num_ctx % align == 0 and (sub.plan.ctx_lo_M % align == 0).all()
            outs.append(d.forward_packed(emb, feats[sub.ctx_index_T], sub))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_tiled_and_dense_flop_counts_match_torch_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    # The math backend runs the scores as two matmuls the counter sees (the fused CPU kernel it
    # does not count); the pairs it computes are the kernel's, whichever backend runs them.
    B, heads, d = 4, 4, 8
    lo, hi, T = _ranges(B=B)
    q, k, v = (t.detach().float() for t in _qkv(len(lo) * B, T, heads=heads, d=d))
    for kernel in ("tiled", "dense"):
        plan = build_plan(lo, hi, T, B, CPU, kernel)
        with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):
            block_attention(q, k, v, plan, 0.3)
        executed, _ = attention_flops(lo, hi, T, B, kernel)
        assert fc.get_total_flops() == 4 * d * heads * executed, kernel


def test_the_flex_plan_reaches_the_device_in_one_transfer(monkeypatch):
    """Item 7 of issue 23: the six plan tensors went to the GPU as six blocking copies per sub-batch;
    now one buffer (pinned on CUDA), one non-blocking copy. `meta` stands in for the device."""
    lo, hi, T = _ranges(B=16, seqs=((300, 9), (200, 5), (700, 14)))
    ref = build_plan(lo, hi, T, 16, CPU, "flex").flex_mask
    transfers = []
    real_to, real_as_tensor = torch.Tensor.to, torch.as_tensor

    def to(self, *a, **kw):
        if kw.get("device") is not None or any(isinstance(x, (str, torch.device)) for x in a):  # not dtype casts
            transfers.append(("to", kw.get("non_blocking", False)))
        return real_to(self, *a, **kw)

    def as_tensor(data, *a, **kw):
        if kw.get("device") is not None:
            transfers.append(("as_tensor", False))
        return real_as_tensor(data, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    mask = build_plan(lo, hi, T, 16, torch.device("meta"), "flex").flex_mask
    monkeypatch.undo()
    assert transfers == [("to", True)]
    assert mask.kv_num_blocks.device.type == "meta" and mask.kv_indices.shape == ref.kv_indices.shape
    # The same tensors as before, on CPU: values, and the mask they describe.
    from app.model.attention import int32_to_device

    parts = int32_to_device([np.array([3, 1]), np.arange(6).reshape(2, 3)], CPU)
    assert [p.dtype for p in parts] == [torch.int32] * 2 and parts[1].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert torch.equal(ref.to_dense(), _old_flex_mask(lo, hi, T, 16).to_dense())


def _old_flex_mask(lo, hi, T, B):
    """The BlockMask as main built it: one torch.as_tensor per array."""
    from torch.nn.attention.flex_attention import BlockMask

    from app.model.attention import FLEX_TILE, _flex_tile_lists, _pad_lists

    R = len(lo) * B
    partial, full = _flex_tile_lists(lo, hi, T, B)
    kv_tiles = -(-(T + R) // FLEX_TILE)
    to = lambda a: torch.as_tensor(a, dtype=torch.int32)[None, None]
    (kn, ki), (fn, fi) = _pad_lists(partial, kv_tiles), _pad_lists(full, kv_tiles)
    return BlockMask.from_kv_blocks(to(kn), to(ki), to(fn), to(fi), BLOCK_SIZE=FLEX_TILE, seq_lengths=(R, T + R))
