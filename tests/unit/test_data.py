import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from diloco_p2p.config import DataConfig
from diloco_p2p.data import DataPosition, TokenDataset, build_dataset, default_corpus_files, load_tokens
from diloco_p2p.data.dataset import EVAL_BATCH, ArraySource, KeyedPermutation, is_eval
from diloco_p2p.errors import UserError
from diloco_p2p.model.build import ByteTokenizer

TOK = ByteTokenizer()


def _dataset(key: str, **kw) -> TokenDataset:
    return build_dataset(DataConfig(max_bytes=200_000, **kw), TOK, seq_len=32, order_key=key)


def test_default_corpus_is_real_text_of_several_megabytes():
    files = list(default_corpus_files())
    assert sum(f.stat().st_size for f in files) > 4_000_000
    assert b"def " in files[0].read_bytes() or b"import" in files[0].read_bytes()


def test_eval_split_is_the_same_on_every_node_and_disjoint_from_training():
    a, b = _dataset("node-a"), _dataset("node-b")
    assert all(torch.equal(x, y) for x, y in zip(a.eval_batches(3), b.eval_batches(3), strict=True))
    drawn = a.next_windows(2000)
    assert not any(is_eval(i, a.eval_fraction) for i in drawn)


def test_the_eval_set_is_fixed_batches_of_eval_windows_whatever_the_batch_size():
    d = _dataset("k")
    batches = d.eval_batches(4)
    assert [b.shape for b in batches] == [torch.Size([EVAL_BATCH, 33])] * 4
    assert all(torch.equal(x, y) for x, y in zip(d.eval_batches(2), batches[:2], strict=True))
    first = np.flatnonzero(is_eval(np.arange(d.n_windows), d.eval_fraction))[0]
    assert torch.equal(batches[0][0], torch.from_numpy(d.source.slice(first * 32, first * 32 + 33).astype(np.int64)))


def test_training_order_depends_on_node_key_not_seed():
    a, b, a2 = _dataset("node-a"), _dataset("node-b"), _dataset("node-a")
    first_a, first_b, first_a2 = a.next_batch(8), b.next_batch(8), a2.next_batch(8)
    assert torch.equal(first_a, first_a2)
    assert not torch.equal(first_a, first_b)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_keyed_permutation_is_a_permutation_that_depends_on_its_key(n):
    p, q = KeyedPermutation(n, "a:0"), KeyedPermutation(n, "a:1")
    assert sorted(p[i] for i in range(n)) == list(range(n))
    if n >= 17:
        assert [p[i] for i in range(n)] != [q[i] for i in range(n)]


def test_an_epoch_visits_every_training_window_once_then_reorders():
    d = build_dataset(DataConfig(max_bytes=20_000), TOK, seq_len=32, order_key="k")
    n_train = int((~is_eval(np.arange(d.n_windows), d.eval_fraction)).sum())
    first = d.next_windows(n_train)
    assert sorted(first) == sorted(set(first)) and len(first) == n_train
    assert d.position.epoch == 0
    second = d.next_windows(n_train)
    assert d.position.epoch == 1 and sorted(second) == sorted(first) and second != first


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


def test_memory_does_not_grow_with_the_number_of_windows():
    tokens = np.zeros(50_000_001, dtype=np.uint16)  # 1.5M windows: no per-window array is built
    d = TokenDataset(ArraySource(tokens), seq_len=32, eval_fraction=0.02, order_key="k")
    assert d.next_batch(4).shape == (4, 33)
    assert d.position.offset >= 4 and not hasattr(d, "train_windows")


def test_text_dir_jsonl_parquet_and_saved_dataset_inputs(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "1.txt").write_text("abc " * 50)
    (docs / "2.txt").write_text("xyz " * 50)
    (docs / ".git").mkdir()
    (docs / ".git" / "HEAD").write_text("ref: refs/heads/main")  # hidden: not a document
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["first doc", "second doc"])))
    assert len(load_tokens(DataConfig(path=str(tmp_path / "a.txt")), TOK)) == 1201
    assert len(load_tokens(DataConfig(path=str(docs)), TOK)) == 402
    assert TOK.decode(load_tokens(DataConfig(path=str(jl)), TOK).tolist()) == "first docsecond doc"
    pq.write_table(pa.table({"text": ["p1", "p2"], "n": [1, 2]}), tmp_path / "d.parquet")
    assert TOK.decode(load_tokens(DataConfig(path=str(tmp_path / "d.parquet")), TOK).tolist()) == "p1p2"
    saved = tmp_path / "saved"  # the layout of datasets' Dataset.save_to_disk
    saved.mkdir()
    with pa.ipc.new_stream(saved / "data-00000-of-00001.arrow", pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": ["s1", "s2", "s3"]}))
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    assert TOK.decode(load_tokens(DataConfig(path=str(saved)), TOK).tolist()) == "s1s2s3"


def test_bad_data_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_tokens(DataConfig(path=str(tmp_path / "missing")), TOK)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(UserError, match="bad.jsonl: row 2 has no 'text' field"):
        load_tokens(DataConfig(path=str(bad)), TOK)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    with pytest.raises(UserError, match="corpus too small"):
        build_dataset(DataConfig(path=str(tiny)), TOK, seq_len=32, order_key="k")
