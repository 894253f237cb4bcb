"""attention.decode_graph_split_kv: the per-shape rule of "auto" (split while a shape's unsplit
pass leaves SMs idle) and the config's values (CPU)."""

from __future__ import annotations

import pytest

from worker.attention.flashinfer_metadata import graph_decode_splits_kv


def test_auto_splits_a_captured_decode_shape_only_while_it_leaves_sms_idle():
    h200 = 132
    # tinyllama-1.1b's 4 KV heads: split up to 32 rows (128 CTAs), not from 33 (132)
    assert [graph_decode_splits_kv("auto", r, 4, h200) for r in (1, 8, 32, 33, 64, 256)] == \
        [True, True, True, False, False, False]
    # llama-3-8b's 8: split up to 16 rows
    assert [graph_decode_splits_kv("auto", r, 8, h200) for r in (1, 16, 17, 64)] == [True, True, False, False]
    assert graph_decode_splits_kv(True, 256, 8, h200) and not graph_decode_splits_kv(False, 1, 8, h200)
    with pytest.raises(ValueError, match="true, false or 'auto', got 'sometimes'"):
        graph_decode_splits_kv("sometimes", 1, 8, h200)


def test_the_config_takes_auto_true_and_false_for_the_split(checkpoint_dir):
    from configkit import ConfigError
    from deploy.config import load_config

    path = checkpoint_dir("tiny-llama")
    assert load_config(None, [f"model.path={path}"]).attention.decode_graph_split_kv == "auto"
    for value, expected in (("true", True), ("false", False), ("auto", "auto")):
        cfg = load_config(None, [f"model.path={path}", f"attention.decode_graph_split_kv={value}"])
        assert cfg.attention.decode_graph_split_kv == expected
    with pytest.raises(ConfigError, match="attention.decode_graph_split_kv"):
        load_config(None, [f"model.path={path}", "attention.decode_graph_split_kv=sometimes"])
