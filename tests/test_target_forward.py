"""A job's features: padding, the target forward and packing (no Ray)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from app.data.target_forward import job_hidden_batch
from tests.toy import save_tiny_target


def test_job_hidden_batch_matches_one_forward_per_sequence(tmp_path: Path) -> None:
    model = save_tiny_target(tmp_path, vocab=64, hidden=32, layers=4)
    seqs = [(np.arange(4, 14), np.r_[np.zeros(4), np.ones(6)].astype(np.uint8)),
            (np.arange(20, 26), np.ones(6, np.uint8))]
    hb = job_hidden_batch(model, seqs, job_id=7, layer_ids=[1, 2], device=torch.device("cpu"))
    assert hb.job_id == 7 and hb.hidden_dtype == "float32"
    assert hb.hidden_BSD.shape == (2, 10, 64) and hb.lengths_B.tolist() == [10, 6]
    assert hb.loss_mask_BS[1, 6:].sum() == 0 and hb.loss_mask_BS[0].tolist() == seqs[0][1].tolist()
    for row, (ids, _) in enumerate(seqs):  # right padding must not change the real positions
        with torch.inference_mode():
            hs = model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
        alone = torch.cat([hs[2], hs[3]], dim=-1)[0].numpy()
        assert np.allclose(hb.hidden_BSD[row, : len(ids)], alone, atol=1e-5)
