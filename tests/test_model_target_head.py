"""TargetHead reads embed_tokens and lm_head alone from a saved target (plain, tied, sharded)."""
from __future__ import annotations

import torch

from app.model.target_head import TargetHead
from tests.toy import save_tiny_target


def test_loads_untied_embed_and_head(tmp_path):
    model = save_tiny_target(tmp_path)
    head = TargetHead.load(tmp_path)
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(head.lm_head.weight, head.embed_tokens.weight)
    assert not any(p.requires_grad for p in head.parameters())
    ids = torch.tensor([[1, 5, 7]])
    h = torch.randn(1, 3, 32)
    torch.testing.assert_close(head.logits(h), model.lm_head(h))
    assert torch.equal(head.embed(ids), model.get_input_embeddings()(ids))


def test_tied_embeddings_share_one_tensor(tmp_path):
    model = save_tiny_target(tmp_path, tie=True)
    head = TargetHead.load(tmp_path, dtype=torch.bfloat16)
    assert head.lm_head.weight.data_ptr() == head.embed_tokens.weight.data_ptr()
    assert head.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight.to(torch.bfloat16))


def test_sharded_checkpoint(tmp_path):
    model = save_tiny_target(tmp_path / "src")
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    head = TargetHead.load(tmp_path / "sharded")
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)
