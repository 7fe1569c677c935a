"""What one speculative step costs on this machine, for `python -m app.bench quality --target smol`'s race.

A verify forward of the anchor and k drafts is not free beside a one-token forward, and neither is the draft:
speculative decoding gains only where tau pays for both. `step_costs` times, on the target's KV cache at a
real context, a forward of k + 1 tokens for each k (verify(k+1)) against a forward of one token (verify(1),
what plain greedy decoding pays per token), and the drafter's block of k + 1 positions with its LM-head rows
(draft). From those and the drafter's per-position acceptance, `block_choice` estimates the speedup of each
block size: tau_b / ((verify(b) + draft(b)) / verify(1)), tau_b = 1 + the acceptance of positions 1..b-1
(a block of b drafts b-1 guesses). The race measures the configured block; this says which block a CPU wants.
"""
from __future__ import annotations

import statistics
import time

import torch


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, first-call paths)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.no_grad()
def step_costs(target, drafter, head, prompt: list[int], layer_ids, blocks: list[int], context_tokens: int = 96,
               repeats: int = 7) -> dict:
    """{"verify_1_ms", per block b: "verify_ms"[b] (a forward of b tokens on the cache), "draft_ms"[b]}."""
    from app.model.spec_decode import _TargetRunner, draft_block, prefused

    runner = _TargetRunner(target, list(layer_ids), use_cache=True)
    ids = list(prompt)
    greedy, feats = runner.run(ids, 0)
    start = 0
    while len(ids) < len(prompt) + context_tokens:  # a real context: greedy tokens on the cache
        start = len(ids)
        ids.append(greedy[-1])
        greedy, more = runner.run(ids, start)
        feats = torch.cat([feats, more])
    n = len(ids)
    context = drafter.fuse_context(feats[:n])

    def verify(b: int):
        def run():
            runner.run(ids + [ids[-1]] * b, n)  # b new positions (anchor + b-1 drafts); only the cost matters
            runner.keep(n)
        return run

    def draft(b: int):
        def run():
            with prefused(drafter):
                draft_block(drafter, head, context, ids[-1], b)
        return run

    out = {"verify_1_ms": _median_ms(verify(1), repeats), "verify_ms": {}, "draft_ms": {}}
    for b in blocks:
        out["verify_ms"][b] = _median_ms(verify(b), repeats)
        out["draft_ms"][b] = _median_ms(draft(b), repeats)
    return out


def block_choice(costs: dict, tau_pos: list[float]) -> dict:
    """Per block size b: tau_b from the per-position acceptance and the estimated speedup over greedy."""
    v1 = costs["verify_1_ms"]
    est = {}
    for b in costs["verify_ms"]:
        tau_b = 1.0 + sum(tau_pos[:b - 1])
        est[b] = {"tau": tau_b, "cost": (costs["verify_ms"][b] + costs["draft_ms"][b]) / v1,
                  "speedup": tau_b * v1 / (costs["verify_ms"][b] + costs["draft_ms"][b])}
    return est
