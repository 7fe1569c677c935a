"""Target features from a truncated forward: the decoder runs only up to the deepest requested layer.

The full HF path (`app.model.features.target_features`) runs every decoder layer, the LM head over
every token (16,384 x 151,936 logits per default job) and keeps all hidden states, to use five of them.
`TargetTrunk` instead calls the model's own base model (`model.model`: embeddings, masks, rotary and
whatever else the architecture does before its layers, all HF's code) with forward hooks on the
requested decoder layers: each hook copies its layer's output into one preallocated feature tensor,
and the hook on the deepest layer stops the forward by raising. No LM head, no logits, no layer above
the deepest, and no hidden state that is not a feature stays alive. The features are the very
tensors the full path would return, so they are bit-identical (tests/test_target_trunk.py).

One subtlety: HF's `hidden_states[-1]` is the *normed* last hidden state. When the last decoder layer
is requested, the forward runs to the end and that slot takes `last_hidden_state`, as the full path does.

Packing: `features(..., position_ids_BS=...)` with one row of concatenated sequences whose positions
restart at 0 per sequence runs them without padding. HF turns such position ids into per-sequence
attention (varlen flash-attention on CUDA; a block-diagonal mask with sdpa/eager).

A model whose decoder layers are not reachable the usual way (`model.model.layers` or
`model.<base_model_prefix>.layers`) falls back to the full path, with a warning.
"""
from __future__ import annotations

import threading
import warnings

import torch


class _StopForward(Exception):
    """Raised by the deepest requested layer's hook: nothing above it is needed."""


def find_base_and_layers(model) -> tuple[torch.nn.Module, torch.nn.ModuleList] | None:
    """(base model, its decoder layers) for HF causal LMs laid out the usual way, else None."""
    prefix = getattr(model, "base_model_prefix", "model") or "model"
    for name in dict.fromkeys((prefix, "model")):
        base = getattr(model, name, None)
        layers = getattr(base, "layers", None) if isinstance(base, torch.nn.Module) else None
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0 and callable(base):
            return base, layers
    return None


def check_layer_ids(layer_ids, num_layers: int) -> None:
    bad = [l for l in layer_ids if not 0 <= l < num_layers]
    if bad or not layer_ids:
        raise ValueError(f"target_layer_ids {list(layer_ids)} outside the target's layers 0..{num_layers - 1}")


class TargetTrunk:
    """Frozen target that returns `hidden_states[l + 1]` for l in `layer_ids`, concatenated, computing
    only the decoder layers up to max(layer_ids). Falls back to the full HF forward (with a warning)
    when the decoder layers cannot be found. Hooks stay installed but act only inside `features`,
    and only on the calling thread, so the same model serves other callers (e.g. tau evaluation)."""

    def __init__(self, model, layer_ids) -> None:
        self.model, self.layer_ids = model, [int(l) for l in layer_ids]
        found = find_base_and_layers(model)
        self.truncated = found is not None
        self._state = threading.local()
        if found is None:
            warnings.warn(f"{type(model).__name__}: decoder layers not found at model.model.layers; target features "
                          "fall back to the full forward (all layers, LM head, every hidden state)", stacklevel=2)
            return
        self.base, layers = found
        self.num_layers = len(layers)
        # Where the features are gathered: the embedding's device, where the job's ids are. A target spread
        # over several GPUs (app/devices.py plan_target_map) runs its layers elsewhere; the payload is built here.
        try:
            embed = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):  # not an HF model, or one without the accessor
            embed = None
        self.out_device = getattr(getattr(embed, "weight", None), "device", None)  # None: the layer's own
        check_layer_ids(self.layer_ids, self.num_layers)
        self.deepest = max(self.layer_ids)
        # Feature slot(s) of each requested layer; a layer may be listed twice.
        self.slots: dict[int, list[int]] = {}
        for slot, l in enumerate(self.layer_ids):
            self.slots.setdefault(l, []).append(slot)
        self._hooks = [layers[l].register_forward_hook(self._make_hook(l)) for l in self.slots]

    def _make_hook(self, layer: int):
        def hook(_module, _args, output):
            out = getattr(self._state, "out", None)
            if out is None:  # not inside features() on this thread: leave the forward alone
                return None
            h_BSH = output[0] if isinstance(output, tuple) else output
            self._write(h_BSH, layer)
            if layer == self.deepest and self.deepest < self.num_layers - 1:
                raise _StopForward
            return None
        return hook

    def _write(self, h_BSH: torch.Tensor, layer: int) -> None:
        out = self._state.out
        if out == "alloc":  # first hook of the call: now the width and dtype are known
            out = h_BSH.new_empty(*h_BSH.shape[:-1], len(self.layer_ids) * h_BSH.shape[-1], device=self.out_device)
            self._state.out = out
        H = h_BSH.shape[-1]
        for slot in self.slots[layer]:
            out[..., slot * H:(slot + 1) * H].copy_(h_BSH)

    def features(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None = None,
                 position_ids_BS: torch.Tensor | None = None, **attn_kwargs) -> torch.Tensor:
        """[B, S, k*H] features. Padded batches pass `attention_mask_BS`; packed rows pass `position_ids_BS`
        (and optionally flash-attention kwargs such as `cu_seq_lens_q`)."""
        if not self.truncated:
            from app.model.features import target_features

            return target_features(self.model, input_ids_BS, attention_mask_BS, self.layer_ids,
                                   position_ids_BS=position_ids_BS, **attn_kwargs)
        self._state.out = "alloc"
        try:
            try:
                result = self.base(input_ids=input_ids_BS, attention_mask=attention_mask_BS,
                                   position_ids=position_ids_BS, use_cache=False, **attn_kwargs)
            except _StopForward:
                result = None
            out = self._state.out
            if self.deepest == self.num_layers - 1:
                # HF's hidden_states[-1] is the normed output; the full path returns that one.
                assert result is not None, "the forward stops early only below the last layer"
                self._write(result.last_hidden_state, self.deepest)
            assert isinstance(out, torch.Tensor), "a requested layer never ran"
            return out
        finally:
            self._state.out = None

    def remove(self) -> None:
        """Detach the hooks (the model then behaves exactly as before)."""
        for h in getattr(self, "_hooks", []):
            h.remove()
