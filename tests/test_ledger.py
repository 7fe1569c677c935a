"""The acked-job ledger as per-epoch bitmaps: behaves like a set of ids, and round-trips through checkpoints."""
from __future__ import annotations

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.messages import make_job_id
from app.pool.book import Ledger, ids_from_state
from app.training.checkpoint import TrainState, latest_checkpoint, load_checkpoint, read_ledger, save_checkpoint

job_ids = st.builds(make_job_id, st.integers(0, 7), st.integers(0, 5000))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), job_ids), max_size=200), st.lists(job_ids, max_size=50))
def test_ledger_behaves_like_a_set(ops, keep) -> None:
    ledger, ref = Ledger(), set()
    for add, jid in ops:
        (ledger.add if add else ledger.discard)(jid)
        (ref.add if add else ref.discard)(jid)
        assert (jid in ledger) == (jid in ref) and len(ledger) == len(ref)
    assert ledger.ids() == sorted(ref)
    assert ledger.not_in(keep) == sorted(ref - set(keep))
    again = Ledger.from_json(json.loads(json.dumps(ledger.to_json())))
    assert again.ids() == sorted(ref) and len(again) == len(ref)


def test_a_bitmap_costs_an_eighth_of_a_byte_per_job() -> None:
    ledger = Ledger(make_job_id(e, i) for e in range(6) for i in range(100_000))
    assert len(ledger) == 600_000
    blob = json.dumps(ledger.to_json())
    assert len(blob) < 600_000 / 8 * 4 / 3 + 200  # base64 of 75 KB, not 600K numbers


def _state(ledger: list[int]) -> TrainState:
    return TrainState(step=3, epoch=1, ledger=ledger, drafter={"w": torch.zeros(2)})


def test_ledger_round_trips_through_a_checkpoint_as_bitmaps(tmp_path) -> None:
    ids = sorted({make_job_id(e, i) for e in range(3) for i in range(0, 3000, 7)} | {make_job_id(5, 123_456)})
    save_checkpoint(tmp_path, _state(list(reversed(ids))), keep=1)
    ckpt = latest_checkpoint(tmp_path)
    meta = json.loads((ckpt / "state.json").read_text())
    assert "ledger" not in meta and set(meta["ledger_bitmaps"]) == {"0", "1", "2", "5"}
    assert read_ledger(ckpt) == (3, 1, ids)
    assert load_checkpoint(ckpt).ledger == ids


def test_checkpoints_with_an_id_list_still_load(tmp_path) -> None:
    save_checkpoint(tmp_path, _state([]), keep=1)
    ckpt = latest_checkpoint(tmp_path)
    meta = json.loads((ckpt / "state.json").read_text())
    meta.pop("ledger_bitmaps")
    meta["ledger"] = [make_job_id(1, 4), 2, 9]  # the format before the bitmaps
    (ckpt / "state.json").write_text(json.dumps(meta))
    assert read_ledger(ckpt)[2] == [make_job_id(1, 4), 2, 9] == load_checkpoint(ckpt).ledger
    assert ids_from_state({"ledger": [3, 1]}) == [3, 1]
