"""bench quality --target smol's plumbing on the toy target: cached greedy references and features, the
jobs built from the cache, the replay, and the --target switch (the real target runs in the bench itself)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import app.bench.runs.real_data as rd
from app.bench.runs.quality import split_target
from app.bench.runs.quality_real import job_batch, replay

LAYERS = [0, 2]
PROMPTS = [[5, 9, 17, 2], [100, 3], [7, 7, 7, 7, 7, 7, 40]]


def test_target_switch_picks_the_bench_and_passes_the_rest_on():
    assert split_target(["--target", "smol", "--seeds", "0"]) == ("smol", ["--seeds", "0"])
    assert split_target(["--target=smol", "train.epochs=1"]) == ("smol", ["train.epochs=1"])
    assert split_target(["--corpora", "python"]) == ("tiny", ["--corpora", "python"])
    with pytest.raises(SystemExit):
        split_target(["--target", "llama"])


def test_greedy_references_are_cached_per_batch_and_end_at_eos(tiny_target, tmp_path, monkeypatch):
    import app.data.generate as gen
    from app.model.spec_decode import greedy_reference

    model, _ = tiny_target
    calls = []
    real = gen.greedy_generate
    monkeypatch.setattr(gen, "greedy_generate", lambda m, p, *a, **k: calls.append(len(p)) or real(m, p, *a, **k))
    plain = [greedy_reference(model, p, 12) for p in PROMPTS]
    eos = plain[0][4]  # a token the first prompt's output reaches early
    outs = rd.greedy_outputs(model, "toy", PROMPTS, 12, eos, pad_id=0, batch_size=1, cache=tmp_path, log=lambda s: None)
    assert calls == [1, 1, 1]
    for p, out in zip(PROMPTS, outs):
        assert out == greedy_reference(model, p, 12, eos)  # EOS kept where it stopped, as spec decoding sees it
    assert outs[0] == plain[0][:plain[0].index(eos) + 1] and len(outs[0]) < 12  # stopped at EOS, which it kept
    again = rd.greedy_outputs(model, "toy", PROMPTS, 12, eos, pad_id=0, batch_size=1, cache=tmp_path, log=lambda s: None)
    assert again == outs and calls == [1, 1, 1]  # every batch from the cache
    rd.greedy_outputs(model, "toy", PROMPTS[:1], 13, eos, pad_id=0, batch_size=1, cache=tmp_path, log=lambda s: None)
    assert calls == [1, 1, 1, 1]  # another budget is another key


def test_jobs_from_cached_features_equal_the_target_actors_jobs(tiny_target, tmp_path):
    """The drafter receives from the cache what the TargetActor path (job_hidden_batch) gives it: the same ids,
    mask and lengths, and the features up to the bf16 rounding the cache stores them in."""
    from app.data.batching import job_hidden_batch
    from app.model.loss import TrainBatch

    model, _ = tiny_target
    seqs = [p + list(range(20, 20 + k)) for p, k in zip(PROMPTS, (9, 3, 6))]
    masks = [np.array([0] * len(p) + [1] * (len(s) - len(p)), dtype=np.uint8) for p, s in zip(PROMPTS, seqs)]
    feats = rd.sequence_features(model, "toy", seqs, LAYERS, tokens_per_batch=24, cache=tmp_path, log=lambda s: None)
    assert feats.flat.dtype == torch.bfloat16 and feats.offsets == [0, 13, 18, 31]
    dataset = SimpleNamespace(sequence=lambda i: (np.array(seqs[i]), masks[i]))
    job = SimpleNamespace(job_id=7, seq_indices=[1, 2])
    got = job_batch(SimpleNamespace(dataset=dataset), feats, job)
    live = job_hidden_batch(model, [dataset.sequence(i) for i in job.seq_indices], 7, LAYERS, torch.device("cpu"),
                            packed=False, feature_dtype="bfloat16")
    want = TrainBatch.from_hidden_batch(live, "cpu", torch.float32)
    assert torch.equal(got.input_ids_BS, want.input_ids_BS) and torch.equal(got.loss_mask_BS, want.loss_mask_BS)
    assert torch.equal(got.lengths_B, want.lengths_B)
    assert got.hidden_BSD.dtype == want.hidden_BSD.dtype == torch.float32
    for row, n in enumerate(want.lengths_B.tolist()):  # real positions; no drafter reads the padding
        torch.testing.assert_close(got.hidden_BSD[row, :n], want.hidden_BSD[row, :n], rtol=2 ** -7, atol=1e-4)  # bf16
    assert torch.equal(got.hidden_BSD[0, 5:], torch.zeros_like(got.hidden_BSD[0, 5:]))
    again = rd.sequence_features(model, "toy", seqs, LAYERS, cache=tmp_path, log=lambda s: None)
    assert torch.equal(again.flat, feats.flat)  # from the cache


def test_replay_sums_tokens_per_forward_over_prompts():
    prompts, refs = [[1, 2], [3]], [[4, 5, 6, 7], [8, 9, 10]]
    oracle = {0: lambda pre, n: (prompts[0] + refs[0])[len(pre):len(pre) + n],
              1: lambda pre, n: (prompts[1] + refs[1])[len(pre):len(pre) + n]}
    got = replay(lambda i: oracle[i], prompts, refs, block_size=4, max_new_tokens=8)
    assert got["tau"] == pytest.approx(2.5) and got["tau_pos"] == [1.0, 0.5, 0.0]  # forwards of 3 and 2 tokens
    blind = replay(lambda i: (lambda pre, n: []), prompts, refs, block_size=4, max_new_tokens=8)
    assert blind["tau"] == 1.0 and blind["tau_pos"] == [0.0, 0.0, 0.0]


def test_report_prints_one_line_per_proposer_the_budget_curve_and_the_margin(capsys):
    from app.bench.runs.quality_real import Clock, report

    def taus(t):
        return {"tau": t, "tau_pos": [0.5] * 15}

    per_seed = [{"dflash": taus(2.0) | {"curve": [(100, 1.5), (200, 2.0)]}, "untrained": taus(1.0), "zero_features": taus(1.4)},
                {"dflash": taus(2.4) | {"curve": [(200, 2.4)]}, "untrained": taus(1.0)}]
    report([0, 1], per_seed, {"ngram": taus(1.5), "prompt_lookup": taus(1.8)}, Clock(log=lambda s: None))
    lines = [dict(kv.split("=", 1) for kv in ln.split()[1:]) for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("RESULT ")]
    by = {ln.get("drafter", ln["bench"]): ln for ln in lines}
    assert by["dflash"]["tau_seeds"] == "2.000/2.400" and by["dflash"]["tau_mean"] == "2.200"
    assert by["dflash"]["tau_std"] == "0.283" and by["dflash"]["seeds"] == "0/1"
    assert by["zero_features"]["seeds"] == "0" and by["zero_features"]["tau_mean"] == "1.400"  # only seed 0 has it
    assert by["prompt_lookup"]["tau_seeds"] == "1.800/1.800" and by["ngram"]["tau_std"] == "0.000"
    assert by["quality_smol_budget"]["response_tokens"] == "100/200" and by["quality_smol_budget"]["tau"] == "1.500/2.000"
    margin = by["quality_smol_margin"]
    assert margin["best_reference"] == "prompt_lookup" and margin["margin"] == "0.400" and margin["met"] == "False"
    assert margin["features_buy"] == "0.600"  # seed 0: 2.0 - 1.4
