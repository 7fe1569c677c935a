"""bench quality --target smol's plumbing on the toy target: cached greedy references and features, the
jobs built from the cache, the replay, and the --target switch (the real target runs in the bench itself)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import app.bench.runs.real_data as rd
from app.bench.runs.quality import split_target
from app.bench.runs.quality_fit import replay
from app.bench.runs.quality_real import job_batch

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
    from app.data.target_forward import job_hidden_batch
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
    assert got["pos1"] == 1.0  # every forward accepted its first draft
    blind = replay(lambda i: (lambda pre, n: []), prompts, refs, block_size=4, max_new_tokens=8)
    assert blind["tau"] == 1.0 and blind["tau_pos"] == [0.0, 0.0, 0.0]


def test_report_prints_one_line_per_proposer_the_curve_and_the_margin(capsys):
    from app.bench.runs.quality_report import report

    def taus(t, **kw):
        return {"tau": t, "tau_pos": [0.5] * 15, "tau_train": t + 0.5, "pos1": 0.25, "pos1_train": 0.5} | kw

    curve = [{"steps": 10, "cpu_min": 1.0, "tokens": 100, "tau": 1.5, "tau_train": 1.6},
             {"steps": 20, "cpu_min": 2.0, "tokens": 200, "tau": 2.0, "tau_train": 2.5}]
    per_seed = [{"dflash": taus(2.0, curve=curve, anchor_sensitivity=0.4, cpu_min=2.0), "untrained": taus(1.0),
                 "zero_features": taus(1.4), "hybrid": taus(2.2)},
                {"dflash": taus(2.4, curve=curve[1:], anchor_sensitivity=0.6, cpu_min=4.0), "untrained": taus(1.0),
                 "hybrid": taus(2.6)}]
    free = {"bigram": taus(1.2), "ngram": taus(1.5), "prompt_lookup": taus(1.8)}
    means = report([0, 1], per_seed, free, seconds=12.0)
    lines = [dict(kv.split("=", 1) for kv in ln.split()[1:]) for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("RESULT ")]
    by = {ln.get("drafter", ln["bench"]): ln for ln in lines}
    assert by["dflash"]["tau_seeds"] == "2.000/2.400" and by["dflash"]["tau_mean"] == "2.200"
    assert by["dflash"]["tau_std"] == "0.283" and by["dflash"]["seeds"] == "0/1"
    assert by["dflash"]["tau_train"] == "2.700" and by["dflash"]["pos1_train"] == "0.500"
    assert by["dflash"]["anchor_sensitivity"] == "0.500" and by["dflash"]["cpu_min"] == "3.000"
    assert "anchor_sensitivity" not in by["untrained"]  # only where every seed measured it
    assert by["zero_features"]["seeds"] == "0" and by["zero_features"]["tau_mean"] == "1.400"  # only seed 0 has it
    assert by["prompt_lookup"]["tau_seeds"] == "1.800/1.800" and by["ngram"]["tau_std"] == "0.000"
    assert by["bigram"]["tau_train"] == "1.700"
    assert by["quality_smol_curve"]["steps"] == "10/20" and by["quality_smol_curve"]["tau_train"] == "1.600/2.500"
    margin = by["quality_smol_margin"]
    assert margin["best_reference"] == "prompt_lookup" and margin["margin"] == "0.400" and margin["met"] == "False"
    assert margin["features_buy"] == "0.600"  # seed 0: 2.0 - 1.4
    assert margin["fit_gap"] == "0.500" and margin["hybrid_vs_lookup"] == "0.600"
    assert means["hybrid"] == pytest.approx(2.4)


def test_block_choice_weighs_tau_against_verify_and_draft_costs():
    from app.bench.runs.quality_speed import block_choice

    costs = {"verify_1_ms": 10.0, "verify_ms": {2: 11.0, 4: 14.0}, "draft_ms": {2: 4.0, 4: 6.0}}
    est = block_choice(costs, tau_pos=[0.5, 0.25, 0.1])
    assert est[2]["tau"] == pytest.approx(1.5) and est[4]["tau"] == pytest.approx(1.85)
    assert est[2]["speedup"] == pytest.approx(1.5 * 10 / 15) and est[4]["speedup"] == pytest.approx(1.85 * 10 / 20)


def test_references_are_replayed_on_the_training_sample_and_the_held_out_prompts():
    """Both prompt sets are replayed; the bigram table fits its own training text exactly where it is
    unambiguous, and a guess-free proposer gets tau 1 on both."""
    from app.bench.runs.quality_fit import both_sets, references

    train = [([1, 2], [3, 4, 5, 6, 7])]
    seqs = [(np.array(p + r), np.array([0] * len(p) + [1] * len(r))) for p, r in train]
    plan = SimpleNamespace(dataset=type("D", (), {"sequence": lambda self, i: seqs[i], "__len__": lambda self: 1})())
    work = {"block_size": 4, "ref_block": 4, "max_new_tokens": 8,
            "eval": {"prompts": [[9, 3]], "refs": [[4, 9, 3, 4]], "feats": [None]},
            "fit": {"prompts": [train[0][0]], "refs": [train[0][1]], "feats": [None]}}
    got = references(work, plan)
    assert got["bigram"]["tau_train"] == 4.0  # 3 from the prefill, then 4 5 6 drafted right + 7: one forward
    assert got["bigram"]["pos1_train"] == 1.0
    # The references draft at their own block, not the drafter's: on a 9-token answer the table needs
    # three forwards at block 4 (4 5 6 +7, 8 9 10 +11, 12) and one at block 16.
    long = [(np.array([1, 2, *range(3, 13)]), np.array([0, 0] + [1] * 10))]
    plan = SimpleNamespace(dataset=type("D", (), {"sequence": lambda self, i: long[i], "__len__": lambda self: 1})())
    fit = {"prompts": [[1, 2]], "refs": [list(range(3, 13))], "feats": [None]}
    narrow, wide = (references(work | {"ref_block": R, "max_new_tokens": 16, "fit": fit}, plan) for R in (4, 16))
    assert narrow["bigram"]["tau_train"] == 3.0 and wide["bigram"]["tau_train"] == 9.0
    assert narrow["bigram"]["block"] == 4 and wide["prompt_lookup"]["block"] == 16
    blind = both_sets(lambda feats: (lambda i: (lambda pre, n: [])), work)
    assert blind["tau"] == blind["tau_train"] == 1.0 and blind["pos1"] == blind["pos1_train"] == 0.0
