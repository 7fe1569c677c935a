# Over 300 lines: the speculative loop, its greedy reference and the two checks that compare them are one measurement.
"""Greedy speculative decoding with a DFlash drafter, and the acceptance length tau.

Each step drafts one block from the last accepted token ([token, MASK x (B-1)]) with the target
features of every accepted position before it, verifies the block with one target forward, and
accepts the longest prefix the target agrees with plus the target's own next token. Two checks:
- `acceptance_errors`: kept tokens that are not their verify forward's own argmax (a bug in the
  acceptance rule; it cannot see a verify forward that is itself wrong, e.g. a stale KV cache);
- `verify_mismatches`: the speculative output compared with the target's own one-token greedy output
  on the evaluated prompts, token for token; every differing position counts (and each token one output
  has past the other's end). Lossless speculative decoding makes it 0. In exact arithmetic (an fp32
  target on CPU) it must be 0; in bf16 on a GPU the multi-token verify and the one-token reference run
  different kernels and near-ties can flip, so there its share (`verify_share`), the prompt mismatch
  rate and the first divergence are reported, not failed on.

The target keeps a KV cache (cropped to the accepted prefix after each verify); `use_cache=False`
recomputes the whole sequence every forward, as a reference. The greedy baseline uses the same
setting, so tokens/s compare like for like. The drafter's context is fused (`fc` + norm, a per-token
map of the target features) once per position as it is accepted, not again for every block.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from app.model.features import features_from_hidden_states


@dataclass
class SpecResult:
    """Generated tokens (prompt excluded) and how many tokens each verify forward produced."""

    tokens: list[int]
    target_forwards: int  # verify forwards (the prefill forward is not counted)
    accepted_per_forward: list[int] = field(default_factory=list)  # accepted drafts + 1 bonus
    acceptance_errors: int = 0  # kept tokens that are not their verify forward's argmax (an acceptance bug)

    @property
    def verify_mismatches(self) -> int:
        """The old name of `acceptance_errors` (app/model/spec_bench.py reads it); the comparison with
        greedy decoding is `EvalResult.verify_mismatches`."""
        return self.acceptance_errors


@dataclass
class EvalResult:
    """tau = mean tokens per verify forward (bonus included); tokens/s of spec and plain greedy."""

    tau: float
    tok_s: float
    greedy_tok_s: float
    speedup: float
    num_prompts: int
    new_tokens: int
    target_forwards: int
    matches_greedy: bool
    accepted_per_forward: list[int] = field(default_factory=list)  # tokens each verify forward produced
    verify_mismatches: int = 0  # generated tokens that differ from the target's own greedy output
    verify_tokens: int = 0  # generated tokens compared with greedy (0: no baseline)
    acceptance_errors: int = 0  # kept tokens their verify forward's argmax disagrees with: a real bug
    mismatch_rate: float = 0.0  # share of prompts whose output differs from plain greedy decoding
    first_divergence: int = -1  # earliest generated-token index at which a prompt differs from greedy (-1: none)
    exact: bool = True  # output must equal plain greedy token for token (an fp32 target on CPU)

    @property
    def verify_share(self) -> float:
        """Share of the compared tokens that differ from greedy decoding (what bf16 on a GPU reports)."""
        return self.verify_mismatches / self.verify_tokens if self.verify_tokens else 0.0

    @property
    def lossless(self) -> bool:
        """No acceptance bug; where arithmetic is exact, also token for token plain greedy's output."""
        return self.acceptance_errors == 0 and ((self.verify_mismatches == 0 and self.matches_greedy) or not self.exact)


class _TargetRunner:
    """Target forwards over a growing sequence, with or without a KV cache.

    `run(ids, start)` returns the greedy next token and the features for positions start..len-1;
    with a cache only those positions are fed (the cache must hold exactly 0..start-1), without
    one the whole sequence is recomputed and sliced.
    """

    def __init__(self, model, layer_ids, use_cache: bool) -> None:
        self.model, self.layer_ids, self.use_cache = model, layer_ids, use_cache
        self.device = next(model.parameters()).device
        self.cache = None
        if use_cache:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
            # transformers >= 5.24 renames `past_key_values` to `cache` (the old name warns).
            params = inspect.signature(model.forward).parameters
            self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def run(self, ids: list[int], start: int):
        feed = ids[start:] if self.use_cache else ids
        first = start if self.use_cache else 0
        x = torch.tensor([feed], dtype=torch.long, device=self.device)
        pos = torch.arange(first, first + len(feed), device=self.device)[None]
        kw: dict = {"use_cache": False}
        if self.cache is not None:
            kw = {self.cache_kw: self.cache, "use_cache": True}
        out = self.model(input_ids=x, position_ids=pos, output_hidden_states=self.layer_ids is not None, **kw)
        cut = start - first
        greedy = out.logits[0, cut:].argmax(dim=-1).tolist()
        feats = None
        if self.layer_ids is not None:
            feats = features_from_hidden_states(out.hidden_states, self.layer_ids)[0, cut:]
        return greedy, feats

    def keep(self, length: int) -> None:
        """Drop cached positions >= length (rejected drafts)."""
        if self.cache is not None:
            extra = self.cache.get_seq_length() - length
            if extra > 0:
                self.cache.crop(-extra)  # negative = tokens to remove (transformers 4.x and 5.x)


@torch.no_grad()
def greedy_reference(target_model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                    use_cache: bool = True) -> list[int]:
    """Plain greedy decoding of one prompt, one target forward per token: the reference spec_generate
    must equal (batched generation for data regeneration is app/data/generate.py)."""
    runner = _TargetRunner(target_model, None, use_cache)
    ids = list(prompt_ids)
    new: list[int] = []
    start = 0
    while len(new) < max_new_tokens:
        greedy, _ = runner.run(ids, start)
        start = len(ids)
        ids.append(greedy[-1])
        new.append(greedy[-1])
        if greedy[-1] == eos_token_id:
            break
    return new


@torch.no_grad()
def draft_block(drafter, head, context_feats_SD: torch.Tensor, anchor_token: int, block_size: int) -> list[int]:
    """The drafter's greedy guesses for positions anchor+1 .. anchor+B-1 (anchor at position S)."""
    arch = drafter.arch
    dev = context_feats_SD.device
    ids = torch.full((1, block_size), arch.mask_token_id, dtype=torch.long, device=dev)
    ids[0, 0] = anchor_token
    dtype = next(drafter.parameters()).dtype
    S = context_feats_SD.shape[0]
    hidden = drafter(head.embed(ids).to(dtype), context_feats_SD[None], torch.tensor([[S]], device=dev))
    logits = head.logits(hidden[0, 1:].to(head.lm_head.weight.dtype))
    return logits.argmax(dim=-1).tolist()


class prefused:
    """Within the block, the drafter takes context it has already fused (its `fuse_context` is the identity),
    so a decoder fuses each position once instead of the whole context for every block."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def __enter__(self):
        self.drafter.fuse_context = lambda x: x  # an instance attribute shadows the method

    def __exit__(self, *exc):
        del self.drafter.fuse_context


@torch.no_grad()
def spec_generate(
    target_model,
    drafter,
    head,
    prompt_ids: list[int],
    max_new_tokens: int,
    layer_ids,
    block_size: int,
    eos_token_id: int | None = None,
    use_cache: bool = True,
) -> SpecResult:
    """Greedy speculative decoding; the tokens equal `greedy_reference`'s."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; speculative decoding needs at least one prompt token")
    runner = _TargetRunner(target_model, list(layer_ids), use_cache)
    greedy, context = runner.run(list(prompt_ids), 0)
    ids = list(prompt_ids) + [greedy[-1]]
    new = [greedy[-1]]  # `context` holds the fused features of every position before the last token
    context = drafter.fuse_context(context)
    result = SpecResult(tokens=new, target_forwards=0)
    while len(new) < max_new_tokens and new[-1] != eos_token_id:
        n = len(ids) - 1  # anchor position; the cache (if any) holds positions 0..n-1
        with prefused(drafter):
            drafts = draft_block(drafter, head, context, ids[-1], block_size)
        drafts = drafts[: max_new_tokens - len(new) - 1]  # the bonus token fills the last slot
        greedy, feats = runner.run(ids + drafts, n)
        # greedy[i] is the target's token for position n + i + 1, the slot of drafts[i].
        accepted = accepted_prefix(drafts, greedy)
        produced = drafts[:accepted] + [greedy[accepted]]
        if eos_token_id is not None and eos_token_id in produced:
            produced = produced[: produced.index(eos_token_id) + 1]
        result.acceptance_errors += sum(a != b for a, b in zip(produced, greedy))  # a correct rule: all zero
        # Positions n .. n+len(produced)-1 (anchor + accepted drafts) are now final context.
        context = torch.cat([context, drafter.fuse_context(feats[: len(produced)])], dim=0)
        ids += produced
        new += produced
        runner.keep(len(ids) - 1)
        result.target_forwards += 1
        result.accepted_per_forward.append(len(produced))
    return result


def accepted_prefix(drafts: list[int], greedy: list[int]) -> int:
    """How many drafts the verify forward confirms: the longest prefix equal to its own argmax."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return accepted


def token_differences(a: list[int], b: list[int]) -> int:
    """Positions at which two outputs differ, each token one has past the other's end counted once."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where a and b differ (the shorter one's length if one is a prefix); -1 if equal."""
    if a == b:
        return -1
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def exact_arithmetic(target_model) -> bool:
    """fp32 (or fp64) on CPU: the verify pass and the one-token reference round alike, so they must agree."""
    p = next(target_model.parameters())
    return p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64)


def measure_tau(
    target_model,
    drafter,
    head,
    prompts: list[list[int]],
    max_new_tokens: int,
    layer_ids,
    block_size: int,
    eos_token_id: int | None = None,
    baseline: bool = True,
    use_cache: bool = True,
    references: dict | None = None,
) -> EvalResult:
    """Run spec (and, with `baseline`, plain greedy) decoding on every prompt; tau and tokens/s.

    Without the baseline, greedy_tok_s/speedup are 0 and matches_greedy is not checked (True).
    `lossless` is the verdict to act on (see the module docstring): no acceptance bug, and, on an fp32
    CPU target, identical to plain greedy; `mismatch_rate` and `first_divergence` say how far bf16 drifted.
    `references` caches the greedy outputs across calls with the same frozen target (evaluations
    during a run): a cached prompt is still checked against its greedy output, which is a fixed
    function of the target, but costs no decoding; greedy_tok_s and speedup cover only the prompts
    decoded in this call (0 when none was).
    """
    spec_s = greedy_s = 0.0
    new_tokens = forwards = accepted = greedy_tokens = 0
    same = True
    per_forward: list[int] = []
    diverged: list[int] = []  # first divergence of each prompt that differs from greedy
    verify_mismatches = verify_tokens = acceptance_errors = 0
    for prompt in prompts:
        t0 = time.perf_counter()
        res = spec_generate(target_model, drafter, head, prompt, max_new_tokens, layer_ids, block_size, eos_token_id,
                            use_cache)
        t1 = time.perf_counter()
        if baseline:
            key = (tuple(prompt), max_new_tokens, eos_token_id)
            ref = references.get(key) if references is not None else None
            if ref is None:
                ref = greedy_reference(target_model, prompt, max_new_tokens, eos_token_id, use_cache)
                greedy_s += time.perf_counter() - t1
                greedy_tokens += len(ref)
                if references is not None:
                    references[key] = ref
            if (at := first_difference(res.tokens, ref)) >= 0:
                same = False
                diverged.append(at)
            verify_mismatches += token_differences(res.tokens, ref)
            verify_tokens += max(len(res.tokens), len(ref))
        acceptance_errors += res.acceptance_errors
        spec_s += t1 - t0
        new_tokens += len(res.tokens)
        forwards += res.target_forwards
        accepted += sum(res.accepted_per_forward)
        per_forward += res.accepted_per_forward
    tok_s = new_tokens / max(spec_s, 1e-9)
    greedy_tok_s = greedy_tokens / greedy_s if baseline and greedy_s > 0 else 0.0
    return EvalResult(
        tau=accepted / max(forwards, 1),
        tok_s=tok_s,
        greedy_tok_s=greedy_tok_s,
        speedup=tok_s / greedy_tok_s if greedy_tok_s else 0.0,
        num_prompts=len(prompts),
        new_tokens=new_tokens,
        target_forwards=forwards,
        matches_greedy=same,
        accepted_per_forward=per_forward,
        verify_mismatches=verify_mismatches,
        verify_tokens=verify_tokens,
        acceptance_errors=acceptance_errors,
        mismatch_rate=len(diverged) / max(len(prompts), 1),
        first_divergence=min(diverged, default=-1),
        exact=exact_arithmetic(target_model),
    )
