"""Target features in transit: as computed, or FP8 (e4m3) with one float32 scale per token.

`model.feature_dtype=float8_e4m3` halves the payload (1 byte per feature instead of bf16's 2, plus 4
bytes per token for its scale): half the target's device-to-host copy, the object store, the pool's
byte budget and the network between nodes. The target encodes on its device before the host copy; the
drafter decodes back to its compute dtype after its host-to-device copy.

Per-token scales: each token's feature vector (all layers concatenated) is divided by its own
max |x| / 448 (e4m3's largest finite value), so a token with large activations does not crush the
resolution of the others. e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element
(half an ulp), about 3% RMS; tested in tests/test_feature_codec.py.
"""
from __future__ import annotations

import numpy as np
import torch

FEATURE_DTYPES = ("bfloat16", "float8_e4m3")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_NAME = "float8_e4m3"


CHUNK_ELEMENTS = 2**24  # float32 temporaries of 64 MiB at a time, not 2x the whole payload


def encode_fp8(feats_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes_BSD uint8, scales_BS float32) on the features' device: feats ~= codes * scale per token.
    Computed in float32, a chunk of tokens at a time (a 640 MiB bf16 job would need 2.7 GB of temporaries)."""
    *lead, D = feats_BSD.shape
    flat = feats_BSD.reshape(-1, D)
    codes = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=flat.device)
    scales = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, D))
    for i in range(0, flat.shape[0], rows):
        x = flat[i:i + rows].float()
        amax = x.abs().amax(dim=-1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # all-zero tokens: any scale
        scales[i:i + rows] = s
        codes[i:i + rows] = (x / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).reshape(*lead, D), scales.reshape(lead)


def decode_fp8(codes_BSD: torch.Tensor, scales_BS: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The features back in `dtype` from uint8 codes and per-token scales (same device), a chunk at a time."""
    *lead, D = codes_BSD.shape
    flat = codes_BSD.reshape(-1, D).view(torch.float8_e4m3fn)
    s_flat = scales_BS.reshape(-1).to(torch.float32)
    out = torch.empty(flat.shape, dtype=dtype, device=flat.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, D))
    for i in range(0, flat.shape[0], rows):
        out[i:i + rows] = flat[i:i + rows].to(torch.float32) * s_flat[i:i + rows, None]
    return out.reshape(*lead, D)


def payload_width(feature_dtype: str, compute_width: int) -> tuple[int, int]:
    """(bytes per feature, extra bytes per token) in transit: FP8 is 1 byte plus a float32 scale per token;
    otherwise the compute dtype's own width and nothing extra."""
    return (1, 4) if feature_dtype == FP8_NAME else (compute_width, 0)


def decode_numpy(codes: np.ndarray, scales: np.ndarray, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """From the payload's numpy arrays (read-only object-store views): codes uint8, scales float32."""
    import warnings

    with warnings.catch_warnings():  # read-only buffers: we only read them
        warnings.simplefilter("ignore", UserWarning)
        c, s = torch.from_numpy(codes), torch.from_numpy(scales)
    return decode_fp8(c.to(device), s.to(device), dtype)
