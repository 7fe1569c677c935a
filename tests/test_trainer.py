"""The drafter step without Ray: LR schedule, global-weight normalisation across ranks, dry ranks."""
from __future__ import annotations

import threading

import pytest
import torch

from app.config.drafter_sections import DrafterConfig, TrainConfig
from app.model.drafter import DFlashDrafter
from app.model.loss import TrainBatch
from app.model.target_head import TargetHead
from tests.toy import tiny_arch
from app.training.trainer import DrafterTrainer, warmup_cosine

BLOCK = 4


def test_warmup_then_cosine_to_zero() -> None:
    f = warmup_cosine(100, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5, abs=0.02)
    assert f(100) == pytest.approx(0.0, abs=1e-9) and f(500) == pytest.approx(0.0, abs=1e-9)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


class ThreadReducer:
    """Sums flat tensors across `n` threads, like an all-reduce across ranks."""

    def __init__(self, n: int) -> None:
        self.buf: list[torch.Tensor] = []
        self.lock = threading.Lock()
        self.posted = threading.Barrier(n)
        self.read = threading.Barrier(n, action=self.buf.clear)  # runs once, after every rank has read

    def __call__(self, flat: torch.Tensor) -> None:
        with self.lock:
            self.buf.append(flat.clone())
        self.posted.wait()
        total = torch.stack(self.buf).sum(0)
        self.read.wait()
        flat.copy_(total)


@pytest.fixture(scope="module")
def parts(vocab64_target):
    config, target_dir = vocab64_target
    arch = tiny_arch(config, num_layers=1, block_size=BLOCK, mask_token_id=3)
    head = TargetHead.load(target_dir)
    g = torch.Generator().manual_seed(0)

    def batch(n: int, S: int) -> TrainBatch:
        ids = torch.randint(4, 64, (n, S), generator=g)
        mask = torch.ones(n, S)
        mask[:, : S // 3] = 0
        hidden = torch.randn(n, S, arch.feature_dim, generator=g)
        return TrainBatch(ids, mask, hidden, torch.full((n,), S))

    return arch, head, [batch(1, 24), batch(3, 40)]


def _trainer(arch, head, reducer=None) -> DrafterTrainer:
    torch.manual_seed(0)
    drafter = DFlashDrafter(arch)
    dcfg = DrafterConfig(num_layers=1, block_size=BLOCK, num_anchors=8, mask_token_id=3, ce_chunk_rows=16)
    tcfg = TrainConfig(lr=1e-2, warmup_ratio=0.0, grad_accum=2, sample_every=0)
    kw = {"reducer": reducer} if reducer else {}
    return DrafterTrainer(drafter, head, dcfg, tcfg, total_steps=10, device=torch.device("cpu"), **kw)


def test_two_ranks_match_one_rank_with_both_batches(parts) -> None:
    """Loss weights are normalised by the GLOBAL sum: a rank with more tokens weighs more."""
    arch, head, (small, big) = parts
    single = _trainer(arch, head)
    single.micro_step(small, job_id=1)
    single.micro_step(big, job_id=2)
    ref = single.finish_step()

    reducer = ThreadReducer(2)
    ranks = [_trainer(arch, head, reducer), _trainer(arch, head, reducer)]
    results = [None, None]

    def go(r: int, batch, job: int) -> None:
        ranks[r].micro_step(batch, job_id=job)
        results[r] = ranks[r].finish_step()

    threads = [threading.Thread(target=go, args=(0, small, 1)), threading.Thread(target=go, args=(1, big, 2))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results[0].loss == pytest.approx(ref.loss, rel=1e-5)
    assert results[0].weight_sum == pytest.approx(ref.weight_sum, rel=1e-6)
    for p_ref, p0, p1 in zip(single.drafter.parameters(), ranks[0].drafter.parameters(), ranks[1].drafter.parameters()):
        assert torch.allclose(p0, p1)  # replicas stay identical
        assert torch.allclose(p_ref, p0, atol=1e-6)


def test_a_dry_rank_joins_with_zeros(parts) -> None:
    arch, head, (small, _) = parts
    reducer = ThreadReducer(2)
    ranks = [_trainer(arch, head, reducer), _trainer(arch, head, reducer)]
    out = [None, None]

    def busy() -> None:
        ranks[0].micro_step(small, job_id=1)
        out[0] = ranks[0].finish_step()

    def dry() -> None:
        out[1] = ranks[1].finish_step(eos=True)

    threads = [threading.Thread(target=busy), threading.Thread(target=dry)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert out[0].active_ranks == 1 and out[0].eos_ranks == 1 and out[1].step == 1
    assert ranks[0].step == ranks[1].step == 1  # both stepped on the one rank's gradients
    for p0, p1 in zip(ranks[0].drafter.parameters(), ranks[1].drafter.parameters()):
        assert torch.allclose(p0, p1)


def test_a_step_with_no_weight_does_not_move_the_weights(parts) -> None:
    arch, head, _ = parts
    t = _trainer(arch, head)
    before = [p.detach().clone() for p in t.drafter.parameters()]
    stats = t.finish_step(eos=True)
    assert stats.active_ranks == 0 and t.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, t.drafter.parameters()))


def test_top5_accuracy_only_on_sampling_steps(parts) -> None:
    arch, head, (small, _) = parts
    t = _trainer(arch, head)
    t.tcfg = TrainConfig(lr=1e-2, warmup_ratio=0.0, grad_accum=1, sample_every=2)
    seen = []
    for step in range(4):
        t.micro_step(small, job_id=step)
        seen.append(t.finish_step().topk_acc)
    assert seen[0] == -1.0 and seen[2] == -1.0
    assert 0.0 <= seen[1] <= 1.0 and 0.0 <= seen[3] <= 1.0


def test_sampled_softmax_steps_report_the_full_vocabulary_loss_on_sampling_steps(parts) -> None:
    """drafter.loss_negatives trains on a slice; a sampling step also gives the full vocabulary's loss of the
    same rows: on the first step (same weights, same anchors) exactly the full-head trainer's own loss."""
    from dataclasses import replace

    arch, head, (small, _) = parts

    def first_step(negatives: int, sample_every: int):
        t = _trainer(arch, head)
        t.dcfg = replace(t.dcfg, loss_negatives=negatives)
        t.tcfg = TrainConfig(lr=1e-2, warmup_ratio=0.0, grad_accum=1, sample_every=sample_every)
        t.micro_step(small, job_id=0)
        return t.finish_step()

    full, sampled = first_step(0, 1), first_step(8, 1)
    assert full.full_loss == pytest.approx(full.loss)  # the full head: its loss is the full loss
    assert sampled.full_loss == pytest.approx(full.loss, rel=1e-5)  # measured on the same rows
    assert abs(sampled.loss - sampled.full_loss) > 1e-3  # it trained on the slice's loss, not the full head's
    assert first_step(8, 2).full_loss == -1.0  # not a sampling step: not measured


def test_bf16_autocast_keeps_fp32_master_weights_that_move(parts) -> None:
    """Norm weights sit at 1.0, where a bf16 weight cannot take a ~lr-sized AdamW step."""
    arch, head, (small, _) = parts
    t = _trainer(arch, head)
    t.autocast = torch.bfloat16
    norm = t.drafter.norm.weight
    before = norm.detach().clone()
    t.micro_step(TrainBatch(small.input_ids_BS, small.loss_mask_BS, small.hidden_BSD.bfloat16(), small.lengths_B),
                 job_id=1)
    t.finish_step()
    assert norm.dtype == torch.float32 and not torch.equal(norm, before)


def _nan_batch(batch: TrainBatch) -> TrainBatch:
    hidden = batch.hidden_BSD.clone()
    hidden[0, :] = float("nan")  # poisoned hidden states: this rank's loss and grads turn nan
    return TrainBatch(batch.input_ids_BS, batch.loss_mask_BS, hidden, batch.lengths_B)


def _two_ranks_one_poisoned(arch, head, parts_batches, on_nonfinite: str):
    small, big = parts_batches
    reducer = ThreadReducer(2)
    ranks = [_trainer(arch, head, reducer), _trainer(arch, head, reducer)]
    for r in ranks:
        r.tcfg = TrainConfig(lr=1e-2, warmup_ratio=0.0, grad_accum=2, sample_every=0, on_nonfinite=on_nonfinite)
    out = [None, None]

    def go(r: int, batch) -> None:
        ranks[r].micro_step(batch, job_id=r)
        out[r] = ranks[r].finish_step()

    before = [[p.detach().clone() for p in r.drafter.parameters()] for r in ranks]
    threads = [threading.Thread(target=go, args=(0, small)), threading.Thread(target=go, args=(1, _nan_batch(big)))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return ranks, out, before


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_nan_on_one_rank_is_seen_by_every_rank_and_never_applied(parts, mode) -> None:
    """Issue 22 item 4: the verdict comes from the all-reduced loss and grad norm, so the healthy rank
    agrees with the poisoned one; the update is not applied (weights and AdamW state unchanged)."""
    arch, head, batches = parts
    ranks, out, before = _two_ranks_one_poisoned(arch, head, batches, mode)
    assert out[0].nonfinite == out[1].nonfinite == "loss=nan grad_norm=nan"
    assert out[0].halt is out[1].halt is (mode == "stop")
    for r, ref in zip(ranks, before):
        assert all(torch.equal(a, b) for a, b in zip(ref, r.drafter.parameters()))
        assert r.optimizer.state == {} and r.step == 1  # the step slot is consumed, nothing learned


def test_skip_goes_on_with_finite_steps_and_stops_on_nonfinite_weights(parts) -> None:
    """Item 4, skip: the next finite step trains as usual; once the weights themselves are nan
    (skipping cannot recover them), the verdict halts even under skip."""
    arch, head, (small, _) = parts
    t = _trainer(arch, head)
    t.tcfg = TrainConfig(lr=1e-2, warmup_ratio=0.0, grad_accum=1, sample_every=0, on_nonfinite="skip")
    t.micro_step(_nan_batch(small), job_id=0)
    skipped = t.finish_step()
    assert (skipped.nonfinite != "", skipped.halt) == (True, False)
    before = [p.detach().clone() for p in t.drafter.parameters()]
    t.micro_step(small, job_id=1)
    ok = t.finish_step()
    assert (ok.nonfinite, ok.halt, t.step) == ("", False, 2)
    assert not all(torch.equal(a, b) for a, b in zip(before, t.drafter.parameters()))
    with torch.no_grad():
        next(t.drafter.parameters()).fill_(float("inf"))
    t.micro_step(small, job_id=2)
    broken = t.finish_step()
    assert broken.halt and broken.nonfinite.endswith(", the weights are non-finite")
