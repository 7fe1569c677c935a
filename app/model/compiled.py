"""torch.compile for the drafter's layers and flex attention: one graph per code, whatever the sub-batch.

Both compile with dynamic shapes, because every sub-batch has its own row count, context length and
BlockMask tile counts. Dynamo's duck sizing would give sizes that are equal at the first trace one
symbol: a first sub-batch whose row count equals the hidden size, or whose query-tile count equals the
head count, is then specialized and the next sub-batch recompiles (past `recompile_limit` a frame runs
eagerly for the rest of the process). Duck shapes are therefore off while these compile. Sizes 0 and 1
are still specialized by Dynamo: a plan of a single query tile compiles flex once more.

`CompileCount` counts the graphs Dynamo compiles per code object (tests and `bench gpu --acceptance`).
"""
from __future__ import annotations

import collections
import functools
from typing import Callable

import torch


def no_duck_shapes():
    """Context: sizes equal at a trace stay separate symbols (entered around every compiled call)."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False)


def compile_dynamic(fn: Callable, backend="inductor") -> Callable:
    """`fn` compiled with dynamic shapes and without duck sizing."""
    compiled = torch.compile(fn, dynamic=True, backend=backend)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with no_duck_shapes():
            return compiled(*args, **kwargs)

    return call


LAYER_BACKEND = "inductor"  # what `train.compile` compiles the layers with (CPU tests use aot_eager)


def compile_layers(drafter: torch.nn.Module, backend=None) -> None:
    """Compile each decoder layer in place (the layers share one code, so they share graphs too). The
    callers enter `no_duck_shapes()` around the forward and backward (`DrafterTrainer.micro_step`)."""
    for layer in drafter.layers:
        layer.compile(dynamic=True, backend=backend or LAYER_BACKEND)


class CompileCount:
    """Context: graphs Dynamo compiles while it is open, per code object (`graphs`, `recompiled`)."""

    def __init__(self) -> None:
        self.per_code: collections.Counter = collections.Counter()

    def __enter__(self) -> "CompileCount":
        from torch._dynamo.convert_frame import register_bytecode_hook

        self._handle = register_bytecode_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _hook(self, code, new_code) -> None:
        self.per_code[f"{code.co_name}:{code.co_filename}:{code.co_firstlineno}"] += 1

    @property
    def graphs(self) -> int:
        return sum(self.per_code.values())

    @property
    def recompiled(self) -> dict[str, int]:
        """Codes compiled more than once, with their count (empty when nothing recompiled)."""
        return {k: n for k, n in self.per_code.items() if n > 1}
