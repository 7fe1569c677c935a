"""The optimizer step's transient memory, measured on the trainer's own code (for `python -m app.bench memory`).

`DrafterTrainer.finish_step` flattens the gradients into one all-reduce buffer, frees them, clips and
runs AdamW. What that adds above the training state (weights, gradients, AdamW's two moments) is
measured here, not assumed: a small drafter trains one step on CPU (so AdamW's moments exist), then a
second step runs under a dispatch mode that follows every storage alive (the state's, and each op's
output until it is freed) and keeps the peak. The excess over the state, per trainable parameter, is
what the step adds at any width: every buffer involved is a per-parameter list (the fused kernel and
the foreach ops both work tensor by tensor over the same parameters).

Only what ATen ops allocate is seen; a kernel's private workspace is not (the fused AdamW kernel needs
none beyond its outputs). `impl` picks AdamW's implementation: "fused" (what the trainer uses on CUDA)
or "foreach" (its CPU path, and the CUDA path before issue 37).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class StepPeak:
    """Bytes the optimizer step adds above the training state, per trainable parameter."""

    impl: str
    per_param: float  # peak excess during finish_step (flatten, all-reduce, clip, AdamW) / trainable parameters
    adamw_per_param: float  # of it, the excess while `optimizer.step` runs, over what was alive when it began
    params: int  # trainable parameters of the measured drafter


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive: those of `start` and every op output, each until it is freed; `peak`."""

    def __init__(self, start: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in start:
            self._track(t)
        self.base = self.peak = self.now()
        self.inner_base = self.inner_peak = -1  # the same, within `inner()` (optimizer.step)

    def inner(self, fn):
        """`fn` wrapped so its own excess over what was alive when it began is kept (inner_peak - inner_base)."""
        def run(*a, **kw):
            self.inner_base = self.inner_peak = self.now()
            try:
                return fn(*a, **kw)
            finally:
                self.inner_peak = max(self.inner_peak, self.now())
        return run

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        known = self.live.get(st._cdata)
        if known is None or known[0].expired():  # a freed storage's address can come back for a new one
            self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())

    def now(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(n for _, n in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        now = self.now()
        self.peak = max(self.peak, now)
        if self.inner_base >= 0:
            self.inner_peak = max(self.inner_peak, now)
        return out


def _small_trainer(impl: str):
    """A 2-layer drafter on CPU (the default drafter's layer kinds, narrow) with a fixed random batch."""
    import app.training.trainer as tr
    from app.config.drafter_sections import DrafterConfig, TrainConfig
    from app.model.arch import DrafterArch
    from app.model.drafter import DFlashDrafter
    from app.model.loss import TrainBatch
    from app.model.target_head import TargetHead

    target = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "head_dim": 16, "intermediate_size": 128, "vocab_size": 256}
    dcfg = DrafterConfig(num_layers=2, block_size=4, num_anchors=8, mask_token_id=3)
    arch = DrafterArch.from_target(target, dcfg, [0, 2])
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    trainer = tr.DrafterTrainer(DFlashDrafter(arch), TargetHead(torch.randn(256, 64, generator=g),
                                                                torch.randn(256, 64, generator=g)),
                                dcfg, replace(TrainConfig(), compile="off"), total_steps=10, device=torch.device("cpu"))
    fused = impl == "fused"
    for group in trainer.optimizer.param_groups:  # the implementation asked, whatever this device would pick
        group.update(fused=fused, foreach=not fused)
    lengths = torch.tensor([40, 27, 33])
    S = int(lengths.max())
    mask = (torch.arange(S)[None] < lengths[:, None]).float()
    batch = TrainBatch(torch.randint(0, 256, (3, S), generator=g), mask,
                       torch.randn(3, S, arch.feature_dim, generator=g), lengths)
    return trainer, batch


def measure_step_peak(impl: str = "fused") -> StepPeak:
    """One warm step (AdamW's moments are born in the first), then the measured one."""
    if impl not in ("fused", "foreach"):
        raise ValueError(f"impl={impl!r}; use 'fused' or 'foreach'")
    trainer, batch = _small_trainer(impl)
    params = [p for p in trainer.drafter.parameters() if p.requires_grad]
    trainer.micro_step(batch, job_id=0)
    trainer.finish_step()
    trainer.micro_step(batch, job_id=1)
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    grads = [p.grad for p in params if p.grad is not None]
    mode = LiveBytes(params + grads + state)
    del grads, state  # only the trainer holds them now, as in a run
    trainer.optimizer.step = mode.inner(trainer.optimizer.step)
    with mode:
        trainer.finish_step()
    n = sum(p.numel() for p in params)
    return StepPeak(impl, (mode.peak - mode.base) / n, (mode.inner_peak - mode.inner_base) / n, n)
