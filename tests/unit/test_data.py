import json

import numpy as np
import pytest
import torch

from diloco_p2p.config import DataConfig
from diloco_p2p.data import DataPosition, TextDataset, build_dataset, default_corpus_files, load_tokens
from diloco_p2p.errors import UserError
from diloco_p2p.model import ByteTokenizer

TOK = ByteTokenizer()


def _dataset(key: str, **kw) -> TextDataset:
    return build_dataset(DataConfig(max_bytes=200_000, **kw), TOK, seq_len=32, order_key=key)


def test_default_corpus_is_real_text_of_several_megabytes():
    files = list(default_corpus_files())
    assert sum(f.stat().st_size for f in files) > 4_000_000
    assert b"def " in files[0].read_bytes() or b"import" in files[0].read_bytes()


def test_eval_split_is_the_same_on_every_node_and_disjoint_from_training():
    a, b = _dataset("node-a"), _dataset("node-b")
    assert np.array_equal(a.eval_windows, b.eval_windows)
    assert not set(a.eval_windows) & set(a.train_windows)
    assert all(torch.equal(x, y) for x, y in zip(a.eval_batches(4, 3), b.eval_batches(4, 3), strict=True))


def test_training_order_depends_on_node_key_not_seed():
    a, b, a2 = _dataset("node-a"), _dataset("node-b"), _dataset("node-a")
    first_a, first_b, first_a2 = a.next_batch(8), b.next_batch(8), a2.next_batch(8)
    assert torch.equal(first_a, first_a2)
    assert not torch.equal(first_a, first_b)


def test_position_restore_continues_without_repeat_or_skip():
    straight = _dataset("k")
    batches = [straight.next_batch(4) for _ in range(6)]
    resumed = _dataset("k")
    for _ in range(3):
        resumed.next_batch(4)
    saved = DataPosition(**vars(resumed.position))
    fresh = _dataset("k")
    fresh.position = saved
    assert all(torch.equal(fresh.next_batch(4), b) for b in batches[3:])


def test_epoch_wraps_with_a_new_order():
    d = _dataset("k")
    n = len(d.train_windows)
    d.position = DataPosition(0, n - 2)
    d.next_batch(4)
    assert d.position == DataPosition(1, 2)


def test_text_dir_and_jsonl_inputs(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "1.txt").write_text("abc " * 50)
    (docs / "2.txt").write_text("xyz " * 50)
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in ["first doc", "second doc"]))
    assert len(load_tokens(DataConfig(path=str(tmp_path / "a.txt")), TOK)) == 1201
    assert len(load_tokens(DataConfig(path=str(docs)), TOK)) == 402
    tokens = load_tokens(DataConfig(path=str(jl)), TOK)
    assert TOK.decode(tokens.tolist()) == "first docsecond doc"


def test_bad_data_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_tokens(DataConfig(path=str(tmp_path / "missing")), TOK)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(UserError, match="line 2"):
        load_tokens(DataConfig(path=str(bad)), TOK)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    with pytest.raises(UserError, match="corpus too small"):
        build_dataset(DataConfig(path=str(tiny)), TOK, seq_len=32, order_key="k")
