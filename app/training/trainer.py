"""One drafter replica's training step, without Ray.

A step is `grad_accum` micro-batches on every rank. Each micro-batch backpropagates its weighted
cross-entropy SUM; at the step boundary the ranks all-reduce the gradients together with the step's
statistics in one flat tensor, and every rank divides by the GLOBAL weight sum, so ranks with more
loss tokens weigh more. A rank with no data joins the same collective with zeros. The collective is
injected (`Reducer`), so the single-process case and tests need no torch.distributed.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from app.config.drafter_sections import DrafterConfig, TrainConfig
from app.faults import injected_delay

# Layout of the statistics that ride along with the gradients in the step's all-reduce.
_STATS = ("weight_sum", "loss_sum", "correct_sum", "topk_correct_sum", "tokens", "accept_len_sum", "num_blocks",
          "active", "stop", "eos", "jobs", "full_loss_sum", "full_measured")
TOPK = 5  # the expensive metric: top-5 accuracy over the full vocabulary, every train.sample_every steps


class Reducer(Protocol):
    """Sums a flat float tensor across all ranks, in place."""

    def __call__(self, flat: torch.Tensor) -> None: ...


def local_reducer(flat: torch.Tensor) -> None:
    """World size 1: the sum is the tensor itself."""


def warmup_cosine(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warmup over warmup_ratio of the steps, then cosine to zero."""
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@dataclass
class StepStats:
    """Global statistics of one optimizer step (identical on every rank after the all-reduce)."""

    step: int  # optimizer steps done, this one included
    loss: float
    accuracy: float
    accept_len: float
    weight_sum: float
    tokens: int
    active_ranks: int  # ranks that trained on something this step
    eos_ranks: int  # ranks whose stream has ended
    stop: bool
    grad_norm: float
    lr: float
    per_pos_acc: list[float] = field(default_factory=list)
    topk_acc: float = -1.0  # weighted top-5 accuracy; -1 when this step did not sample it
    local_tokens: int = 0
    local_loss: float = 0.0
    compute_s: float = 0.0
    nonfinite: str = ""  # why this step was not applied ("loss=nan grad_norm=inf"); "" = a finite step
    halt: bool = False  # a non-finite step the run must stop at (train.on_nonfinite=stop, or nan weights)
    # The full vocabulary's loss of this step's rows: = loss without sampling; with drafter.loss_negatives, measured
    # on sampling steps only (-1 on the others): the exact figure the sampled loss is checked against.
    full_loss: float = -1.0


class StepAccumulator:
    """This rank's sums over the micro-batches of the current step."""

    def __init__(self, block_size: int) -> None:
        self.sums = dict.fromkeys(_STATS, 0.0)
        self.pos_correct = torch.zeros(block_size - 1, dtype=torch.float64)
        self.pos_count = torch.zeros(block_size - 1, dtype=torch.float64)
        self.job_ids: list[int] = []

    def add(self, out, job_id: int) -> None:  # out: app.model.loss.LossOutput
        self.sums["weight_sum"] += float(out.weight_sum)
        self.sums["loss_sum"] += float(out.loss_sum.detach())
        self.sums["correct_sum"] += float(out.correct_sum)
        self.sums["topk_correct_sum"] += float(out.topk_correct_sum)
        self.sums["tokens"] += float(out.tokens)
        self.sums["accept_len_sum"] += float(out.accept_len_sum)
        self.sums["num_blocks"] += float(out.num_blocks)
        self.pos_correct += out.per_pos_correct.detach().double().cpu()
        self.pos_count += out.per_pos_count.detach().double().cpu()
        self.job_ids.append(job_id)
        self.sums["jobs"] += 1.0
        self.sums["active"] = 1.0
        if out.full_loss_sum >= 0:  # the full vocabulary's loss of these rows (always, without sampling)
            self.sums["full_loss_sum"] += float(out.full_loss_sum)
            self.sums["full_measured"] += float(out.weight_sum)


def adamw_impl(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation for `device`: fused on CUDA (one kernel over every parameter, no temporaries;
    the foreach path's sqrt buffer is one fp32 per parameter, 3.9 GiB at the default drafter), foreach on CPU."""
    return {"fused": True, "foreach": False} if device.type == "cuda" else {"fused": False, "foreach": True}


def device_adamw_on_load(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """After `load_state_dict` (a post hook): the saved param groups carry the saving process's flags, so
    a checkpoint written on CPU would resume foreach on CUDA, and one written on CUDA fused on CPU. Put this
    device's flags back; the fused kernel wants each `step` on its parameter's device, the others on the CPU."""
    impl = adamw_impl(device)
    for group in optimizer.param_groups:
        group.update(impl)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(p.device if impl["fused"] else "cpu", torch.float32)


def use_compile(setting: str, device: torch.device) -> bool:
    """`train.compile`: auto = on for CUDA (where the fused kernels pay), off for CPU."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


class DrafterTrainer:
    """Drafter, frozen target head, AdamW and the warmup-cosine schedule of one replica."""

    def __init__(self, drafter: torch.nn.Module, head: torch.nn.Module, dcfg: DrafterConfig,
                 tcfg: TrainConfig, total_steps: int, device: torch.device, reducer: Reducer = local_reducer,
                 autocast: torch.dtype | None = None, total_jobs: int = 0, delay_s: float = 0.0):
        """`drafter` holds float32 master weights; `autocast` (bf16 on GPU) is the compute dtype.
        `delay_s` (`faults.drafter_delay_s`) is added to every micro-batch: a drafter slow by construction.

        With `total_jobs` > 0 the LR schedule runs on jobs consumed (summed over ranks), not on steps:
        steps made smaller by drains then do not push the schedule past its end (LR 0 for the rest)."""
        self.drafter, self.head, self.dcfg, self.tcfg = drafter, head, dcfg, tcfg
        # fp16 has no loss scaling here: the drafter computes in bf16 whenever a half dtype is asked.
        self.autocast = torch.bfloat16 if autocast is not None else None
        self.device, self.reducer, self.delay_s = device, reducer, delay_s
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.95),
                                           **adamw_impl(device))
        self.optimizer.register_load_state_dict_post_hook(lambda opt: device_adamw_on_load(opt, device))
        self.jobs_per_unit = total_jobs > 0  # the scheduler's last_epoch counts jobs instead of steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(total_jobs if self.jobs_per_unit else total_steps, tcfg.warmup_ratio))
        self.step = 0
        self.acc = StepAccumulator(dcfg.block_size)
        drafter.activation_checkpointing = tcfg.activation_checkpointing
        if use_compile(tcfg.compile, device):
            # Per process (each actor compiles its own), per layer: the layers are identical, so one
            # graph serves all five; dynamic shapes, no duck sizing (app/model/compiled.py).
            from app.model.compiled import compile_layers

            compile_layers(drafter)

    def micro_step(self, batch, job_id: int) -> None:
        """Forward + backward of one micro-batch (a target job) in sub-batches of at most
        `drafter.max_rows` query rows; anchors depend only on (seed, job)."""
        from app.model.compiled import no_duck_shapes
        from app.model.loss import dflash_loss

        gen = torch.Generator(device="cpu").manual_seed(self.tcfg.seed * 1_000_003 + job_id)
        topk = TOPK if self.sampling_step() else 0
        self.drafter.train()
        injected_delay(self.delay_s)
        with torch.autocast(self.device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None), \
                no_duck_shapes():  # compiled layers: one graph whatever the sub-batch sizes
            out = dflash_loss(
                self.drafter, self.head, batch, block_size=self.dcfg.block_size, num_anchors=self.dcfg.num_anchors,
                gamma=self.dcfg.gamma, ce_chunk_rows=self.dcfg.ce_chunk_rows, generator=gen, topk=topk,
                max_rows=self.dcfg.max_rows, backward=True, negatives=self.dcfg.loss_negatives,
                full_check=topk > 0,
            )
        self.acc.add(out, job_id)

    def sampling_step(self) -> bool:
        """Whether the step being accumulated computes the expensive metrics."""
        return self.tcfg.sample_every > 0 and (self.step + 1) % self.tcfg.sample_every == 0

    def finish_step(self, stop_requested: bool = False, eos: bool = False) -> StepStats:
        """All-reduce grads + stats, normalise by the global weight sum, clip, step, schedule."""
        t0 = time.perf_counter()
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        local = self.acc.sums | {"stop": float(stop_requested), "eos": float(eos)}
        stats = torch.tensor([local[k] for k in _STATS], dtype=torch.float32)
        pos = torch.cat([self.acc.pos_correct, self.acc.pos_count]).float()
        # One flat fp32 buffer: a single collective per step (gloo and nccl both like few, large calls).
        flat = torch.cat([g.detach().reshape(-1).float() for g in grads] + [stats.to(self.device), pos.to(self.device)])
        # Free the gradients now: the flat buffer holds them, and becomes them (scaled in place) in _apply;
        # kept, they would sit beside it and AdamW's temporaries at the step's peak (+4 bytes per parameter).
        del grads
        self.optimizer.zero_grad(set_to_none=True)
        self.reducer(flat)
        n_grad = flat.numel() - stats.numel() - pos.numel()
        g_stats = dict(zip(_STATS, flat[n_grad:n_grad + len(_STATS)].tolist()))
        g_pos = flat[n_grad + len(_STATS):].cpu()
        weight = g_stats["weight_sum"]
        grad_norm, lr = 0.0, self.scheduler.get_last_lr()[0]
        # Weighted top-5 accuracy on sampling steps (weights as the loss); -1 on other steps.
        topk_acc = g_stats["topk_correct_sum"] / weight if self.sampling_step() and weight > 0 else -1.0
        nonfinite, halt = "", False
        if weight > 0:
            grad_norm = self._apply(params, flat[:n_grad].div_(weight), jobs=int(g_stats["jobs"]),  # no copy
                                    loss_sum=g_stats["loss_sum"])
            nonfinite, halt = self._verdict(g_stats["loss_sum"] / weight, grad_norm, params)
        else:  # nothing to learn this step; do not carry stale gradients into the next one
            self.optimizer.zero_grad(set_to_none=True)
        half = g_pos.numel() // 2
        per_pos = (g_pos[:half] / g_pos[half:].clamp(min=1)).tolist()
        accuracy = float(g_pos[:half].sum() / g_pos[half:].sum().clamp(min=1))  # top-1 over predicted positions
        result = StepStats(
            step=self.step, loss=g_stats["loss_sum"] / max(weight, 1e-12), accuracy=accuracy,
            accept_len=g_stats["accept_len_sum"] / max(g_stats["num_blocks"], 1.0), weight_sum=weight,
            tokens=int(g_stats["tokens"]), active_ranks=int(g_stats["active"]), eos_ranks=int(g_stats["eos"]), stop=g_stats["stop"] > 0,
            grad_norm=grad_norm, lr=lr, per_pos_acc=per_pos, topk_acc=topk_acc, local_tokens=int(self.acc.sums["tokens"]),
            local_loss=self.acc.sums["loss_sum"] / max(weight, 1e-12), compute_s=time.perf_counter() - t0,
            nonfinite=nonfinite, halt=halt,
            full_loss=g_stats["full_loss_sum"] / g_stats["full_measured"] if g_stats["full_measured"] > 0 else -1.0,
        )
        self.acc = StepAccumulator(self.dcfg.block_size)
        return result

    def _apply(self, params: list[torch.nn.Parameter], flat_grad: torch.Tensor, jobs: int = 1,
               loss_sum: float = 0.0) -> float:
        """Clip and step; a non-finite loss or grad norm (the all-reduced ones: every rank sees the
        same) is never applied: the weights and AdamW's moments stay as they were."""
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat_grad[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.tcfg.max_grad_norm))
        applied = math.isfinite(norm) and math.isfinite(loss_sum)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.jobs_per_unit:  # advance by the jobs this step consumed (LambdaLR.step adds the last one)
            self.scheduler.last_epoch += max(1, jobs) - 1
        with warnings.catch_warnings():  # a skipped step still consumed its jobs: the schedule runs on
            if not applied:  # torch warns of a scheduler step before any optimizer step; intended here
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.step += 1
        return norm

    def _verdict(self, loss: float, grad_norm: float, params: list[torch.nn.Parameter]) -> tuple[str, bool]:
        """("", False) for a finite step; else why, and whether the run stops: always with
        train.on_nonfinite=stop, and with skip when the weights themselves are no longer finite (an
        earlier update overflowed them): skipping could not recover, every later step would be nan."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return "", False
        why = f"loss={loss:.4g} grad_norm={grad_norm:.4g}"
        if self.tcfg.on_nonfinite == "stop":
            return why, True
        with torch.no_grad():
            weights_ok = all(bool(torch.isfinite(p).all()) for p in params)
        return (why, False) if weights_ok else (why + ", the weights are non-finite", True)
