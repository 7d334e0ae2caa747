"""The inner optimizer under ``inner.optimizer=muon`` (MuLoCo): which parameters Muon takes, the
schedule of both lrs, bit-exact resume from a checkpoint, and a swarm of mixed optimizers."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diloco_p2p.config import InnerConfig, load_config
from diloco_p2p.contract import RoundOutcome
from diloco_p2p.errors import UserError
from diloco_p2p.local.muon import ShardedMuon
from diloco_p2p.local.ranks import Ranks
from diloco_p2p.loop.checkpoint import load_checkpoint
from diloco_p2p.loop.inner import InnerTrainer, muon_split, warmup_cosine
from diloco_p2p.loop.moments import first_moments
from diloco_p2p.loop.node import Node
from diloco_p2p.model.build import build_model
from diloco_p2p.planner.simulate import Rendezvous, ReplicaSync
from tests.unit.test_node import SMALL, ScriptedSync

CPU = torch.device("cpu")
MUON = ["inner.optimizer=muon"]
TWO_RANK_MUON = [*SMALL, *MUON, "inner.muon_lr=0.01", "inner.total_steps=4", "data.order_key=muon-ranks"]


def _model(**extra):
    return build_model(load_config(None, ["model.preset=tiny", *[f"model.extra.{k}={v}" for k, v in extra.items()]])
                       .model, 259, seed=0)


def _names(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tied", [False, True])
def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_head_and_norms(tied):
    model = _model(tie_word_embeddings=tied)
    hidden, rest = muon_split(model)
    names = {n for n, _ in model.named_parameters()}
    projections = {n for n in names if ("self_attn." in n or "mlp." in n) and n.endswith("_proj.weight")}
    assert len(projections) == 3 * 7 and _names(model, hidden) == projections
    assert _names(model, rest) == names - projections
    assert "model.embed_tokens.weight" in _names(model, rest)
    assert ("lm_head.weight" in names) != tied and not {"lm_head.weight"} & _names(model, hidden)

    trainer = InnerTrainer(model, InnerConfig(optimizer="muon"), 10, CPU)
    assert [p for g in trainer.muon.param_groups for p in g["params"]] == hidden
    adamw = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in adamw} == {id(p) for p in rest}
    decay, no_decay = trainer.optimizer.param_groups
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert trainer.muon.defaults["adjust_lr_fn"] == "match_rms_adamw" and trainer.muon.defaults["momentum"] == 0.95


def test_under_adamw_one_optimizer_holds_every_parameter_and_the_state_keeps_its_keys():
    model = _model()
    trainer = InnerTrainer(model, InnerConfig(), 10, CPU)
    assert trainer.muon is None and list(trainer.optimizers) == ["optimizer"]
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(list(model.parameters()))
    assert set(trainer.state_dict()) == {"optimizer", "scheduler"}


def test_the_schedule_drives_both_lrs():
    cfg = InnerConfig(optimizer="muon", lr=1e-3, muon_lr=3e-3, warmup_steps=3, min_lr_ratio=0.1)
    trainer = InnerTrainer(_model(), cfg, 12, CPU)
    factor = warmup_cosine(3, 12, 0.1)
    data = torch.randint(3, 259, (2, 17), generator=torch.Generator().manual_seed(0))
    for step in range(12):
        assert trainer.lr == pytest.approx(1e-3 * factor(step))
        assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([1e-3 * factor(step)] * 2)
        assert trainer.muon.param_groups[0]["lr"] == pytest.approx(3e-3 * factor(step))
        trainer.step(lambda: data)
    assert trainer.muon.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.1)
    # unset, Muon's lr is inner.lr: match_rms_adamw scales its update to AdamW's
    assert InnerTrainer(_model(), InnerConfig(optimizer="muon", lr=2e-3), 12, CPU).muon.defaults["lr"] == 2e-3


def test_a_muon_node_resumed_from_its_checkpoint_matches_a_straight_run_bit_exactly(tmp_path):
    common = [*SMALL, *MUON, "inner.total_steps=8"]
    straight = Node(load_config(None, [*common, "train.max_rounds=4"]), tmp_path / "straight", ScriptedSync(),
                    progress=False).run()
    Node(load_config(None, [*common, "train.max_rounds=2"]), tmp_path / "resumed", ScriptedSync(),
         progress=False).run()
    ckpt = load_checkpoint(tmp_path / "resumed" / "checkpoints")
    assert ckpt.round == 2 and any(k.startswith("inner.muon.state.") for k in ckpt.tensors)
    assert sorted(p.suffix for p in (tmp_path / "resumed" / "checkpoints").glob("round-000002.*")) == [
        ".json", ".safetensors"]
    resumed = Node(load_config(None, [*common, "train.max_rounds=4"]), tmp_path / "resumed", ScriptedSync(),
                   progress=False)
    assert resumed.round == 2
    momentum = [s["momentum_buffer"] for s in resumed.trainer.muon.state.values()]
    assert momentum and all(m.abs().sum() > 0 for m in momentum)
    records = resumed.run()
    assert [r.round for r in records] == [3, 4]
    assert [r.params_sha256 for r in records] == [r.params_sha256 for r in straight[-2:]]


def test_a_checkpoint_of_the_other_optimizer_is_refused_with_one_line(tmp_path):
    Node(load_config(None, [*SMALL, "train.max_rounds=1"]), tmp_path / "run", ScriptedSync(), progress=False).run()
    with pytest.raises(UserError, match=r"checkpoint round 1 holds inner.optimizer=adamw state, this node runs "
                                        r"muon; resume with --set inner.optimizer=adamw"):
        Node(load_config(None, [*SMALL, *MUON, "train.max_rounds=2"]), tmp_path / "run", ScriptedSync(),
             progress=False)


def _matrices() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 95, bias=False), torch.nn.Linear(95, 64, bias=False))


def _muon_steps(model: torch.nn.Module, muon: type) -> None:
    """Three Muon steps on one fixed batch (on 2 ranks each rank takes the same one: FSDP's mean of two
    equal gradients is that gradient exactly)."""
    optimizer = muon(list(model.parameters()), lr=0.02, adjust_lr_fn="match_rms_adamw")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _muon_rank(rank: int, port: int, root: str) -> None:
    """Rank `rank` of a 2-rank Muon node (gloo on loopback): rounds 1-2 straight in ``straight``, and
    round 1, then a resume from its checkpoint to round 2, in ``resumed``; then a round under
    sync.average_moments in ``moments``."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ranks = Ranks.from_env("cpu", timeout_s=60)
    try:
        from torch.distributed.fsdp import fully_shard

        model = _matrices()
        fully_shard(model, mesh=ranks.mesh)  # 95 rows: 48 on rank 0, 47 on rank 1
        _muon_steps(model, ShardedMuon)
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if ranks.leader:
            save_file(full, str(Path(root) / "matrices.safetensors"))
        for run, rounds in (("straight", 2), ("resumed", 1), ("resumed", 2)):
            node = Node(load_config(None, [*TWO_RANK_MUON, f"train.max_rounds={rounds}"]), Path(root) / run,
                        ScriptedSync(), ranks=ranks, progress=False)
            assert type(node.trainer.muon) is ShardedMuon
            node.run()
        _rank_averages_its_shards_moments(ranks, Path(root) / "moments")
    finally:
        ranks.close()


class _MomentsSync(ScriptedSync):
    """Every round committed; the moments' all-reduce answers each value halved."""

    def __init__(self):
        super().__init__({r: lambda d: RoundOutcome(status="committed", average=d, group_size=2) for r in (1, 2)})
        self.handed: list[torch.Tensor] = []

    def average_moments(self, round, moments, weight):
        self.handed.append(moments.clone())
        return RoundOutcome(status="committed", average=moments / 2, parts=1, parts_committed=1)


def _rank_averages_its_shards_moments(ranks: Ranks, run_dir: Path) -> None:
    """sync.average_moments on 2 ranks: each rank hands in its own shards' moments (one per parameter
    value it holds) and writes the answer back into its sharded optimizer state."""
    sync = _MomentsSync()
    node = Node(load_config(None, [*TWO_RANK_MUON, "train.max_rounds=1", "sync.average_moments=true"]), run_dir,
                sync, ranks=ranks, progress=False)
    node.run()
    held = sum(p.to_local().numel() for p in node.model.parameters())
    assert len(sync.handed) == 1 and sync.handed[0].numel() == held < sum(p.numel() for p in node.model.parameters())
    now = torch.cat([b.reshape(-1) for b in first_moments(node.trainer)])
    assert torch.equal(now, sync.handed[0] / 2)


def test_a_two_rank_muon_node_steps_like_one_rank_and_resumes_bit_exactly(tmp_path):
    """FSDP shards each matrix by rows across the 2 ranks; Muon orthogonalizes it whole
    (`ShardedMuon`): given the same gradients it steps as torch's Muon bit for bit; θ after a round
    is a 1-rank Muon node's with twice the per-rank batch (the same windows) up to how far fp32
    reordering in the gradients moves Newton-Schulz; the 2-rank checkpoint resumes bit-exactly; under
    sync.average_moments each rank averages its own shards' moments (`_rank_averages_its_shards_moments`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_muon_rank, args=(rank, port, str(tmp_path))) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    one = Node(load_config(None, [*TWO_RANK_MUON, "inner.batch_size=4", "train.max_rounds=1"]), tmp_path / "one",
               ScriptedSync(), progress=False)
    one.run()
    for proc in procs:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    two = load_file(str(tmp_path / "straight" / "checkpoints" / "round-000001.safetensors"))
    ref = load_file(str(tmp_path / "one" / "checkpoints" / "round-000001.safetensors"))
    assert sorted(two) == sorted(ref) and any(k.startswith("inner.muon.state.") for k in ref)
    assert all(t.abs().sum() > 0 for k, t in two.items() if k.startswith("inner.muon.state."))  # it stepped
    # Newton-Schulz in bf16 amplifies the gradients' fp32 differences (the mean of two half batches
    # against one batch): θ ends 5% of the round's update away; each shard orthogonalized alone, 83%.
    theta, update = two["outer.theta"] - ref["outer.theta"], ref["outer.momentum"]  # momentum = Δ after one round
    assert torch.linalg.vector_norm(theta) < 0.15 * torch.linalg.vector_norm(update)
    reference = _matrices()  # the same gradients give torch's Muon bit for bit
    _muon_steps(reference, torch.optim.Muon)
    sharded = load_file(str(tmp_path / "matrices.safetensors"))
    assert all(torch.equal(sharded[k], v) for k, v in reference.state_dict().items())
    straight, resumed = (load_file(str(tmp_path / run / "checkpoints" / "round-000002.safetensors"))
                         for run in ("straight", "resumed"))
    assert sorted(straight) == sorted(resumed)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_the_config_checks_muon_fields_and_keeps_them_out_of_the_swarm_hash():
    adamw, muon = load_config(None, []), load_config(None, [*MUON, "inner.muon_lr=0.01", "inner.muon_momentum=0.9"])
    assert (adamw.inner.optimizer, adamw.inner.muon_lr, adamw.inner.muon_momentum) == ("adamw", None, 0.95)
    assert adamw.swarm_hash() == muon.swarm_hash()
    for bad, field in [("inner.optimizer=sgd", "inner.optimizer"), ("inner.muon_lr=0", "inner.muon_lr"),
                       ("inner.muon_momentum=1", "inner.muon_momentum")]:
        with pytest.raises(UserError, match=f"--set {bad}: field '{field}'"):
            load_config(None, [bad])


def test_an_adamw_node_and_a_muon_node_agree_on_theta_every_round(tmp_path):
    configs = {"a": load_config(None, [*SMALL, "train.max_rounds=3"]),
               "b": load_config(None, [*SMALL, *MUON, "train.max_rounds=3"])}
    rendezvous = Rendezvous(list(configs), configs["a"].sync)
    nodes = {k: Node(c, tmp_path / k, ReplicaSync(k, rendezvous), progress=False) for k, c in configs.items()}
    assert nodes["a"].trainer.muon is None and nodes["b"].trainer.muon is not None
    records: dict = {}

    def run(key: str) -> None:
        with rendezvous.baton:
            records[key] = nodes[key].run()

    threads = [threading.Thread(target=run, args=(k,)) for k in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status for r in records["a"]] == ["init"] + ["committed"] * 3
    assert [r.params_sha256 for r in records["a"]] == [r.params_sha256 for r in records["b"]]
    assert records["a"][-1].train_loss != records["b"][-1].train_loss  # each trained its own way
