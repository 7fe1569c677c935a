"""conf/medium.yaml: the CPU rehearsal at real widths, and the tiny builder's words for a real vocabulary."""
from __future__ import annotations


from app.config.load import load_config
from app.tiny.build import synthetic_words, word_offset
from tests.helpers import ROOT


def test_medium_has_real_vocab_and_long_sequences():
    cfg = load_config(ROOT / "conf/medium.yaml", [])
    assert cfg.model.target == "tiny" and cfg.topology.device == "cpu"
    assert cfg.tiny.vocab_size == 151936 and cfg.data.max_length == 2048
    # responses reach the last bucket: 7/4 x response_length plus a short prompt stays within max_length
    assert cfg.data.max_length - 64 <= cfg.tiny.response_length * 7 // 4 <= cfg.data.max_length


def test_synthetic_words_cover_a_real_vocabulary_and_keep_small_ones_unchanged():
    words = synthetic_words(151936 - word_offset())
    assert len(set(words)) == len(words) == 151936 - word_offset()
    assert words[:4970] == synthetic_words(4970)  # small vocabularies (and their cached builds) are as before
    assert all(" " not in w for w in words)
