"""`diloco-p2p prepare` and training on its shards: the same token stream as in memory, resumable
and atomic writes, and every bad input refused with one line."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diloco_p2p.cli import main
from diloco_p2p.config import Config, DataConfig, ModelConfig, diff_swarm_fields, load_config
from diloco_p2p.data import load_tokens, open_dataset
from diloco_p2p.data import prepare as prepare_module
from diloco_p2p.data.dataset import ShardSource
from diloco_p2p.data.encode import token_dtype, tokenizer_identity
from diloco_p2p.data.manifest import Manifest
from diloco_p2p.data.prepare import prepare
from diloco_p2p.errors import UserError
from diloco_p2p.model.build import ByteTokenizer, build_tokenizer

BYTE = ByteTokenizer()
BYTE_ID = tokenizer_identity(ModelConfig(), BYTE)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of text files, JSONL (with a non-UTF-8 document) and Parquet."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta", "eta", "theta", "\n", "def", "return"]
    for i in range(12):
        (root / f"{i:02d}.txt").write_text(" ".join(rng.choice(words, 200 + 37 * i)))
    (root / "rows.jsonl").write_text("\n".join(json.dumps({"text": " ".join(rng.choice(words, 50))})
                                               for _ in range(30)))
    (root / "raw.bin.txt").write_bytes(b"caf\xe9 not utf-8 " * 20)
    pq.write_table(pa.table({"text": [" ".join(rng.choice(words, 80)) for _ in range(20)]}), root / "t.parquet")
    return root


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, corpus):
    """A small ByteLevel BPE trained here with `tokenizers`, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(corpus.glob("[0-9]*.txt"))], trainer)
    out = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>").save_pretrained(str(out))
    return out


def _prepare(inputs, out, tok=BYTE, ident=BYTE_ID, **kw):
    return prepare([str(i) for i in inputs], out, tok, ident, progress=False, **kw)


def _stream(directory):
    source = ShardSource(Manifest.load(directory))
    return source.slice(0, len(source))


def test_prepared_shards_hold_the_in_memory_token_stream(corpus, tmp_path):
    result = _prepare([corpus], tmp_path / "p", shard_tokens=1000)
    m = result.manifest
    assert len(m.shards) > 5 and m.dtype == np.uint16 and result.documents == 12 + 30 + 1 + 20
    assert np.array_equal(_stream(tmp_path / "p"), load_tokens(DataConfig(path=str(corpus)), BYTE))
    cut = _prepare([corpus], tmp_path / "cut", shard_tokens=1000, max_bytes=5000).manifest
    assert np.array_equal(_stream(tmp_path / "cut"), load_tokens(DataConfig(path=str(corpus), max_bytes=5000), BYTE))
    assert cut.id != m.id
    again = _prepare([corpus], tmp_path / "other-place", shard_tokens=1000).manifest
    assert again.id == m.id  # the id is the content's, not the path's


def test_a_bpe_corpus_matches_the_tokenizer_one_document_at_a_time(corpus, bpe_dir, tmp_path):
    model_cfg = ModelConfig(tokenizer_path=str(bpe_dir))
    tok = build_tokenizer(model_cfg)
    ident = tokenizer_identity(model_cfg, tok)
    result = _prepare([corpus], tmp_path / "p", tok, ident, shard_tokens=512)
    assert result.replaced_docs == 1  # the one non-UTF-8 document, replaced and counted
    assert np.array_equal(_stream(tmp_path / "p"), load_tokens(DataConfig(path=str(corpus)), tok))
    assert ident["sha256"] != BYTE_ID["sha256"] and ident["vocab_size"] == tok.vocab_size > 259
    with pytest.raises(UserError, match=rf"prepared with tokenizer .* \(transformers, vocab {tok.vocab_size}\) but this "
                                        r"node's "
                                        r"tokenizer is .* \(byte, vocab 259\)"):
        open_dataset(DataConfig(path=str(tmp_path / "p")), ModelConfig(), BYTE, 16, "k", tmp_path / "cache")


def test_token_dtype_widens_past_uint16():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_an_interrupted_prepare_resumes_to_the_same_dataset(corpus, tmp_path, monkeypatch):
    whole = _prepare([corpus], tmp_path / "whole", shard_tokens=700).manifest
    real = prepare_module.write_shard
    calls = []

    def dies_at_shard_4(out, index, ids, pool=None):
        calls.append(index)
        if index == 4:
            raise KeyboardInterrupt
        return real(out, index, ids, pool)

    monkeypatch.setattr(prepare_module, "write_shard", dies_at_shard_4)
    with pytest.raises(KeyboardInterrupt):
        _prepare([corpus], tmp_path / "p", shard_tokens=700)
    assert sorted(f.name for f in (tmp_path / "p").glob("shard-*")) == [f"shard-0000{i}.bin" for i in range(4)]
    assert not (tmp_path / "p" / "manifest.json").exists()
    calls.clear()
    monkeypatch.setattr(prepare_module, "write_shard", lambda *a: (calls.append(a[1]), real(*a))[1])
    resumed = _prepare([corpus], tmp_path / "p", shard_tokens=700).manifest
    assert calls[0] == 4  # shards 0-3 were kept, not written again
    assert resumed.id == whole.id


def test_disk_full_removes_the_partial_shard_and_a_rerun_resumes(corpus, tmp_path, monkeypatch):
    whole = _prepare([corpus], tmp_path / "whole", shard_tokens=700).manifest
    real_fsync, synced = os.fsync, []

    def full_on_third_shard(fd):
        synced.append(fd)
        if len(synced) == 5:  # shard 0, state, shard 1, state, shard 2
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_on_third_shard)
    with pytest.raises(UserError, match=r"disk full writing .*shard-00002.bin: free space .* resumes at shard 2"):
        _prepare([corpus], tmp_path / "p", shard_tokens=700)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert sorted(f.name for f in (tmp_path / "p").iterdir() if "shard" in f.name) == ["shard-00000.bin",
                                                                                      "shard-00001.bin"]
    assert _prepare([corpus], tmp_path / "p", shard_tokens=700).manifest.id == whole.id


def test_bad_inputs_are_one_line_each(corpus, tmp_path):
    with pytest.raises(UserError, match="missing.txt' does not exist"):
        _prepare([tmp_path / "missing.txt"], tmp_path / "o")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="empty.txt' is empty"):
        _prepare([tmp_path / "empty.txt"], tmp_path / "o")
    (tmp_path / "x.jsonl").write_text('{"body": "a"}\n')
    with pytest.raises(UserError, match=r"x.jsonl: row 1 has no 'text' field"):
        _prepare([tmp_path / "x.jsonl"], tmp_path / "o")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "x.parquet")
    with pytest.raises(UserError, match=r"x.parquet: no 'text' column \(it has body\)"):
        _prepare([tmp_path / "x.parquet"], tmp_path / "o")
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{not json\n')
    with pytest.raises(UserError, match="broken.jsonl: not JSON lines"):
        _prepare([tmp_path / "broken.jsonl"], tmp_path / "o")
    _prepare([corpus], tmp_path / "taken", shard_tokens=5000)
    with pytest.raises(UserError, match=r"--out .*taken already holds dataset [0-9a-f]{12} prepared from other"):
        _prepare([corpus / "00.txt"], tmp_path / "taken")


def test_damaged_shards_and_manifests_are_refused_at_train_start(corpus, tmp_path):
    out = tmp_path / "p"
    m = _prepare([corpus], out, shard_tokens=1000).manifest

    def start():
        return open_dataset(DataConfig(path=str(out)), ModelConfig(), BYTE, 16, "k", tmp_path / "cache")

    assert start().n_windows > 0
    shard = m.path(m.shards[3])
    good = shard.read_bytes()
    shard.write_bytes(good[:-2])
    with pytest.raises(UserError, match=r"shard-00003.bin is truncated or damaged: 1998 bytes, the manifest says 2000"):
        start()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(UserError, match=r"shard-00003.bin is corrupt: its sha256 is not the manifest's"):
        start()
    shard.unlink()
    with pytest.raises(UserError, match=r"shard-00003.bin is missing"):
        start()
    shard.write_bytes(good)
    assert start().n_windows > 0
    content = json.loads((out / "manifest.json").read_text())
    content["eval_fraction"] = 0.4
    (out / "manifest.json").write_text(json.dumps(content))
    with pytest.raises(UserError, match="manifest.json has been edited"):
        start()


def test_the_dataset_id_is_agreed_by_the_swarm_and_names_both_ids(corpus, tmp_path):
    a = _prepare([corpus / "00.txt", corpus / "01.txt"], tmp_path / "a", shard_tokens=1000).manifest
    b = _prepare([corpus / "02.txt", corpus / "03.txt"], tmp_path / "b", shard_tokens=1000).manifest
    ca, cb = (load_config(None, [f"data.path={d}"]) for d in (tmp_path / "a", tmp_path / "b"))
    assert ca.swarm_view()["data.dataset_id"] == a.id
    assert diff_swarm_fields(ca.swarm_view(), cb.swarm_view()) == [f"data.dataset_id: {a.id!r} != {b.id!r}"]
    assert "data.dataset_id" not in Config().swarm_view()  # a plain corpus: as before, older checkpoints resume
    from diloco_p2p.swarm.membership.resync import check_config
    from tests.unit.dht_fixtures import PEERS, make

    swarm = {p: make(p, cfg=cb) for p in PEERS[:2]}  # the swarm trains on b; we start with a
    with pytest.raises(UserError, match=f"data.dataset_id: '{a.id}' != '{b.id}' \\(ours != swarm's\\)"):
        check_config(swarm, ca.swarm_view(), ca.swarm_hash(), PEERS[6])
    pinned = DataConfig(path=str(tmp_path / "a"), dataset_id=b.id)
    with pytest.raises(UserError, match=f"holds dataset {a.id} but data.dataset_id is {b.id}"):
        open_dataset(pinned, ModelConfig(), BYTE, 16, "k", tmp_path / "cache")
    with pytest.raises(UserError, match=f"data.dataset_id is {b.id} .* but data.path is unset"):
        open_dataset(DataConfig(dataset_id=b.id), ModelConfig(), BYTE, 16, "k", tmp_path / "cache")


def test_prepare_cli_prints_the_dataset_and_a_bad_input_exits_2(corpus, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["prepare", str(corpus / "rows.jsonl"), "--out", str(out), "--quiet", "--shard-tokens", "500"]) == 0
    printed = capsys.readouterr().out
    assert f"dataset {Manifest.load(out).id}" in printed and "30 documents" in printed
    assert main(["prepare", str(corpus / "rows.jsonl"), "--out", str(out), "--quiet", "--shard-tokens", "500"]) == 0
    assert "already holds this corpus" in capsys.readouterr().out
    assert main(["prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "o2"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope' does not exist" in err[0]


NODE = ["model.preset=tiny", "inner.batch_size=2", "inner.seq_len=16", "inner.warmup_steps=1",
        "outer.inner_steps=2", "train.eval_batches=1", "train.num_threads=1", "train.device=cpu",
        "data.order_key=k", "inner.total_steps=8"]


def _node(run_dir, data_path, *extra):
    from diloco_p2p.loop.node import Node

    return Node(load_config(None, [*NODE, f"data.path={data_path}", *extra]), run_dir, progress=False)


def test_training_on_shards_resumes_mid_epoch_exactly(corpus, tmp_path):
    _prepare([corpus], tmp_path / "p", shard_tokens=1000)
    straight = _node(tmp_path / "straight", tmp_path / "p", "train.max_rounds=4")
    straight.run()
    first = _node(tmp_path / "resumed", tmp_path / "p", "train.max_rounds=2")
    first.run()
    assert 0 < first.data.position.offset < first.data.n_windows  # stopped mid-epoch
    second = _node(tmp_path / "resumed", tmp_path / "p", "train.max_rounds=4")
    assert second.data.position == first.data.position
    second.run()
    assert second.data.position == straight.data.position
    assert second.params_sha256() == straight.params_sha256()


def test_a_plain_text_path_is_prepared_once_into_the_run_dir(corpus, tmp_path):
    node = _node(tmp_path / "run", corpus / "rows.jsonl", "train.max_rounds=1", "inner.batch_size=3")
    shard = tmp_path / "run" / "data" / "shard-00000.bin"
    written = shard.stat().st_mtime_ns
    assert np.array_equal(node.data.source.slice(0, 10**6),
                          load_tokens(DataConfig(path=str(corpus / "rows.jsonl")), BYTE))
    again = _node(tmp_path / "run", corpus / "rows.jsonl", "train.max_rounds=1", "inner.batch_size=5")
    assert shard.stat().st_mtime_ns == written  # reused, not prepared again
    # The held-out set does not change with inner.batch_size.
    assert all(np.array_equal(a, b) for a, b in zip(node.eval_set, again.eval_set, strict=True))
