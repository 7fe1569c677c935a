"""FP8 features in transit (issue 27, item 3): the codec's error, the payload's bytes, the pool's byte
count, the drafter's decoding on both of its paths (CPU conversion and the CUDA stager, rehearsed on CPU
with a stand-in stream), and the config key."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from actors.target import batch_nbytes
from app.bench.transport.path_ends import FixedTrunk
from app.config.schema import ModelConfig, PoolConfig
from app.data.target_forward import start_job
from app.messages import ItemMeta, JobSpec
from app.model.feature_codec import decode_fp8, decode_numpy, encode_fp8, payload_width
from app.model.loss import TrainBatch
from app.pool.hs_pool import HSPool
from app.payload.staging import PayloadStager


def features(B: int = 2, S: int = 24, D: int = 96, seed: int = 0) -> torch.Tensor:
    """bf16 features whose tokens span six orders of magnitude (per-token scales must not care)."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.linspace(-3, 3, B * S).reshape(B, S, 1)
    return (torch.randn(B, S, D, generator=g) * mag).to(torch.bfloat16)


def job_batch(feature_dtype: str, feats: torch.Tensor):
    B, S, _ = feats.shape
    seqs = [(np.arange(S), np.ones(S, np.uint8)) for _ in range(B)]
    return start_job(FixedTrunk(feats), seqs, 7, torch.device("cpu"), packed=False,
                     feature_dtype=feature_dtype).result()


def test_fp8_round_trip_error_is_bounded_per_element_and_per_token():
    x = features().float()
    codes, scales = encode_fp8(x)
    assert codes.dtype == torch.uint8 and scales.shape == x.shape[:2]
    y = decode_fp8(codes, scales, torch.float32)
    err = (y - x).abs()
    # e4m3: 3 mantissa bits, so half an ulp is 2^-4 of |x| for normals; subnormals (below 2^-6 of the scale
    # grid) round to a 2^-9 step: half of it, times the token's scale, bounds those.
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * scales[..., None] + 1e-30
    assert bool((err <= bound).all())
    rel_rms = (err.pow(2).mean(-1).sqrt() / x.pow(2).mean(-1).sqrt()).flatten()
    assert float(rel_rms.max()) < 0.04  # every token, whatever its magnitude (1e-3 .. 1e3 here)
    assert float(rel_rms.max()) / float(rel_rms.min()) < 1.6  # per-token scales: no token is crushed


def test_fp8_all_zero_token_round_trips_to_zero():
    x = torch.zeros(1, 3, 8)
    x[0, 1] = torch.arange(8.0)
    codes, scales = encode_fp8(x)
    y = decode_fp8(codes, scales, torch.float32)
    assert torch.equal(y[0, 0], torch.zeros(8)) and torch.isfinite(y).all()
    assert torch.allclose(y[0, 1], x[0, 1], rtol=2 ** -4)


def test_fp8_payload_halves_the_bytes_and_the_pool_counts_them():
    feats = features(B=2, S=64, D=256)
    bf16, fp8 = job_batch("bfloat16", feats), job_batch("float8_e4m3", feats)
    assert bf16.hidden_dtype == "bfloat16" and fp8.hidden_dtype == "float8_e4m3"
    assert fp8.hidden_BSD.nbytes * 2 == bf16.hidden_BSD.nbytes
    assert fp8.hidden_scale_BS.dtype == np.float32 and fp8.hidden_scale_BS.shape == (2, 64)
    per_job = {}
    for name, hb in (("bfloat16", bf16), ("float8_e4m3", fp8)):
        pool = HSPool(PoolConfig(capacity=4, min_ready=1), 1)
        pool.add_jobs([JobSpec(1, 0, 1, 0, (0, 1), 128, est_bytes=10**6)])
        j = pool.next_job(0)
        assert pool.job_done(0, ItemMeta(j.job_id, 0, 2, 128, 128, batch_nbytes(hb), 0, 0.0), payload="ref")
        per_job[name] = pool.stats().pool_bytes
    # Real bytes: 2 x 64 x 256 features at 1 byte + 4-byte scales per token + ids, mask, lengths alike.
    small = 2 * 64 * (8 + 1) + 2 * 8
    assert per_job["float8_e4m3"] == 2 * 64 * (256 + 4) + small
    assert per_job["bfloat16"] == 2 * 64 * 256 * 2 + small
    assert per_job["float8_e4m3"] / per_job["bfloat16"] < 0.52  # halved, less the scales and small arrays


def test_the_planned_bytes_per_token_follow_the_feature_dtype():
    assert payload_width("float8_e4m3", 2) == (1, 4)
    assert payload_width("bfloat16", 2) == (2, 0) and payload_width("bfloat16", 4) == (4, 0)


def test_the_drafter_decodes_fp8_alike_on_the_cpu_path_and_the_cuda_stager_path(monkeypatch):
    """The CUDA stager (rehearsed with stand-in stream and event) and the CPU conversion give the same
    features, which are the codec's decoding of what the target sent."""
    feats = features(B=2, S=16, D=64)
    hb = job_batch("float8_e4m3", feats)
    plain = TrainBatch.from_hidden_batch(hb, torch.device("cpu"), torch.float32)

    class Event:
        def record(self, _stream):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    staged = PayloadStager(torch.device("cpu"), torch.float32, side_stream=object()).stage(hb)
    monkeypatch.undo()
    assert torch.equal(staged.hidden_BSD, plain.hidden_BSD)
    assert torch.equal(plain.hidden_BSD, decode_numpy(hb.hidden_BSD, hb.hidden_scale_BS, torch.float32))
    assert float(((plain.hidden_BSD - feats.float()).abs() / feats.float().abs().clamp_min(1e-6)).median()) < 2 ** -4
    for name in ("input_ids_BS", "loss_mask_BS", "lengths_B"):
        assert torch.equal(getattr(staged, name), getattr(plain, name)), name


def test_model_feature_dtype_refuses_other_values():
    assert ModelConfig(target="tiny", feature_dtype="float8_e4m3").feature_dtype == "float8_e4m3"
    with pytest.raises(ValueError, match="model.feature_dtype"):
        ModelConfig(target="tiny", feature_dtype="fp8")


def test_fp8_chunked_codec_equals_one_chunk(monkeypatch):
    """The codec works a chunk of tokens at a time (bounded temporaries); chunks change nothing."""
    import app.model.feature_codec as codec

    x = features(B=2, S=10, D=24)
    whole = codec.encode_fp8(x)
    monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 50)  # two tokens per chunk, the last one short
    chunked = codec.encode_fp8(x)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert torch.equal(codec.decode_fp8(*chunked, torch.bfloat16), codec.decode_fp8(*whole, torch.bfloat16))

