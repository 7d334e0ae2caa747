"""The CUDA path, run for real: bf16 autocast, θ between host and GPU, checkpoints across
devices, NCCL and FSDP2 on one GPU. Skipped where no CUDA device is visible (CI has none);
`benchmarks/gpu/gpu_run.sh` runs them on a GPU machine.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest
import torch

from diloco_p2p.config import load_config
from diloco_p2p.contract import RoundOutcome
from diloco_p2p.loop.checkpoint import load_checkpoint
from diloco_p2p.loop.node import Node
from diloco_p2p.swarm.collective.wire import roundtrip
from tests.unit.test_node import SMALL, ScriptedSync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU = [*SMALL, "train.device=cuda"]


def _node(run_dir, overrides, rounds, sync=None):
    config = load_config(None, [*overrides, f"train.max_rounds={rounds}"])
    return Node(config, run_dir, sync or ScriptedSync(), progress=False)


def test_bf16_autocast_training_learns_on_the_gpu(tmp_path):
    node = _node(tmp_path / "run", [*GPU, "outer.inner_steps=20", "inner.lr=3e-3", "inner.batch_size=8",
                                    "inner.seq_len=64"], rounds=3)
    dtypes = []
    hook = node.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    records = node.run()
    hook.remove()

    assert node.device.type == "cuda" and all(p.device.type == "cuda" for p in node.model.parameters())
    assert set(dtypes) == {torch.bfloat16}  # every forward ran under bf16 autocast ...
    assert all(p.dtype == torch.float32 for p in node.model.parameters())  # ... on fp32 master weights
    assert node.trainer.optimizer.defaults["fused"]
    start, end = records[0].eval_loss, records[-1].eval_loss
    assert end < 0.8 * start, f"eval loss {start:.3f} -> {end:.3f}: bf16 training did not learn"


def test_theta_goes_to_the_gpu_and_back_bit_for_bit(tmp_path):
    node = _node(tmp_path / "run", GPU, rounds=1)
    assert node.outer.pinned and node.outer.theta.is_pinned()
    theta = node.outer.theta.clone()
    node.outer.copy_into(node.layout.local_views())
    delta = node.outer.pseudo_gradient(node.layout.local_views())
    assert torch.equal(delta, torch.zeros_like(delta))  # no step taken: Δ is exactly zero
    assert torch.equal(node.outer.theta, theta)


class PairSwarm:
    """Two in-process nodes that average each round: both Δ through the fp16 wire, the mean
    taken in one fixed order, handed to both (what the all-reduce guarantees its members)."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=120)
        self.deltas: dict[int, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def member(self, name: str) -> ScriptedSync:
        swarm = self

        class Member(ScriptedSync):
            peer_id = name

            def average(self, round, delta, weight, params_hash):
                with swarm.lock:
                    swarm.deltas.setdefault(round, {})[name] = delta.clone()
                swarm.barrier.wait()
                both = swarm.deltas[round]
                mean = (roundtrip(both["gpu"], "fp16") + roundtrip(both["cpu"], "fp16")) / 2
                return RoundOutcome(status="committed", average=mean, group_size=2, contributors=2)

        return Member()


def test_a_gpu_node_and_a_cpu_node_end_each_round_with_the_same_theta(tmp_path):
    swarm = PairSwarm()
    nodes = {"gpu": _node(tmp_path / "gpu", GPU, rounds=3, sync=swarm.member("gpu")),
             "cpu": _node(tmp_path / "cpu", [*SMALL, "train.device=cpu"], rounds=3, sync=swarm.member("cpu"))}
    assert nodes["gpu"].params_sha256() == nodes["cpu"].params_sha256()  # the same seed: the same θ
    results: dict[str, list] = {}

    def run(name):
        results[name] = nodes[name].run()

    threads = [threading.Thread(target=run, args=(name,)) for name in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(results) == {"gpu", "cpu"}, "a node did not finish"

    for round in (1, 2, 3):  # the devices trained differently ...
        assert not torch.equal(swarm.deltas[round]["gpu"], swarm.deltas[round]["cpu"])
    gpu, cpu = ([r.params_sha256 for r in results[n] if r.round > 0] for n in ("gpu", "cpu"))
    assert gpu == cpu and len(set(gpu)) == 3  # ... and every round ended with one θ on both
    assert torch.equal(nodes["gpu"].outer.theta, nodes["cpu"].outer.theta)


def test_a_checkpoint_written_on_the_gpu_resumes_on_the_cpu_and_back(tmp_path):
    run_dir = tmp_path / "run"
    on_gpu = _node(run_dir, GPU, rounds=2)
    on_gpu.run()
    written = load_checkpoint(run_dir / "checkpoints")
    assert written is not None and written.round == 2

    on_cpu = _node(run_dir, [*SMALL, "train.device=cpu"], rounds=3)
    assert (on_cpu.round, on_cpu.step) == (2, written.step)
    assert on_cpu.params_sha256() == written.meta["params_sha256"] == on_gpu.params_sha256()
    state = on_cpu.trainer.optimizer.state_dict()["state"]
    assert state and all(t.device.type == "cpu" for s in state.values() for t in s.values() if t.dim() > 0)
    for a, b in zip(on_cpu.trainer.optimizer.state.values(), on_gpu.trainer.optimizer.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"].cpu())  # AdamW's moments came across exactly
    records = on_cpu.run()
    assert [r.round for r in records] == [3]

    back = _node(run_dir, GPU, rounds=4)
    assert back.round == 3 and back.params_sha256() == records[-1].params_sha256
    assert all(t.device.type == "cuda" for s in back.trainer.optimizer.state.values() for t in s.values()
               if t.dim() > 0)
    assert [r.round for r in back.run()] == [4]


def test_fsdp2_shards_on_one_gpu_rank_over_nccl(tmp_path):
    """One GPU: the NCCL process group and FSDP2 `fully_shard` on one rank (bf16 params, fp32
    reduce), trained by the inner trainer as a sharded node's ranks are."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from diloco_p2p.local.fsdp import ShardLayout, shard_model
    from diloco_p2p.local.ranks import Ranks
    from diloco_p2p.loop.inner import InnerTrainer
    from diloco_p2p.model.build import build_model

    config = load_config(None, [*GPU, "inner.lr=3e-3"])
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            device_id=device)
    try:
        total = torch.tensor([2.0], device=device)
        dist.all_reduce(total)
        assert total.item() == 2.0
        ranks = Ranks(device, 0, 1, init_device_mesh("cuda", (1,)))
        model = shard_model(build_model(config.model, 259, seed=0), ranks, "auto")
        assert all(isinstance(p, DTensor) and p.device.type == "cuda" for p in model.parameters())
        layout = ShardLayout(list(model.parameters()), ranks)
        assert sum(v.numel() for v in layout.local_views()) == sum(layout.full_numels)
        trainer = InnerTrainer(model, config.inner, 40, device, "fp32", ranks)
        assert not trainer.optimizer.defaults["fused"]  # DTensor parameters: the foreach path
        torch.manual_seed(0)
        batch = torch.randint(3, 259, (8, 33))
        losses = [trainer.step(lambda: batch).loss for _ in range(30)]
        assert losses[-1] < 0.5 * losses[0]
    finally:
        dist.destroy_process_group()


def test_two_ranks_on_one_gpu_are_refused_in_one_line(tmp_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs")
    proc = subprocess.run(
        [sys.executable, "-m", "diloco_p2p", "train", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
         *[a for o in GPU for a in ("--set", o)]],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode != 0
    assert "only 1 are visible" in proc.stderr, proc.stderr[-2000:]


def test_muon_trains_on_the_gpu_and_its_checkpoint_resumes_bit_exactly(tmp_path):
    muon = [*GPU, "inner.optimizer=muon", "inner.muon_lr=6e-3", "inner.total_steps=8"]
    straight = _node(tmp_path / "straight", muon, rounds=4)
    assert straight.trainer.optimizer.defaults["fused"]  # AdamW on the rest keeps its fused kernel
    records = straight.run()
    assert all(s["momentum_buffer"].device.type == "cuda" for s in straight.trainer.muon.state.values())
    # Below a uniform prediction, ln(vocab), by 0.3 nats: measured at these settings, on CPU 5.583 ->
    # 5.052, on an H200 5.583 -> 4.976; with Muon's lr ~0 (AdamW alone on embeddings, head and norms)
    # 5.352 on CPU. A fixed drop (the earlier "more than 1.0") held on neither device; a bound on the
    # loss itself is the same on both and still fails when Muon does not train the hidden matrices.
    uniform = math.log(straight.model.lm_head.out_features)
    assert records[-1].eval_loss < uniform - 0.3, f"eval {records[0].eval_loss:.3f} -> {records[-1].eval_loss:.3f}"
    _node(tmp_path / "resumed", muon, rounds=2).run()
    resumed = _node(tmp_path / "resumed", muon, rounds=4)
    assert resumed.round == 2
    assert [r.params_sha256 for r in resumed.run()] == [r.params_sha256 for r in records[-2:]]


def test_muon_steps_fsdp_sharded_parameters_on_the_gpu(tmp_path):
    """FSDP2 on one GPU (NCCL): Muon takes the DTensor matrices (`ShardedMuon`) and trains."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from diloco_p2p.local.fsdp import shard_model
    from diloco_p2p.local.muon import ShardedMuon
    from diloco_p2p.local.ranks import Ranks
    from diloco_p2p.loop.inner import InnerTrainer
    from diloco_p2p.model.build import build_model

    config = load_config(None, [*GPU, "inner.optimizer=muon", "inner.muon_lr=6e-3", "inner.warmup_steps=1"])
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            device_id=device)
    try:
        ranks = Ranks(device, 0, 1, init_device_mesh("cuda", (1,)))
        model = shard_model(build_model(config.model, 259, seed=0), ranks, "auto")
        trainer = InnerTrainer(model, config.inner, 40, device, "auto", ranks)
        assert type(trainer.muon) is ShardedMuon
        batch = torch.randint(0, 259, (4, 33), generator=torch.Generator().manual_seed(0))
        losses = [trainer.step(lambda: batch).loss for _ in range(6)]
        assert all(s["momentum_buffer"].device.type == "cuda" for s in trainer.muon.state.values())
        assert losses[-1] < losses[0] - 0.5, losses  # one batch, six steps: it is learnt
    finally:
        dist.destroy_process_group()
