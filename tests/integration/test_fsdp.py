"""A node of 2 local ranks (FSDP2 on CPU, gloo) as a user starts it: real processes, real run dirs.

The reference is a 1-rank node with twice the per-rank batch, trained in this process: with
one data order per node split across ranks, both see the same windows at every step, so
their global parameters (and AdamW state) must agree up to fp32 rounding.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco_p2p.config import load_config
from diloco_p2p.loop.node import Node
from tests.harness.procs import Proc, Procs, diloco, faulty_train, read_records, wait_until
from tests.harness.settings import set_args
from tests.harness.swarm import ProcessSwarm

ENTRY = faulty_train()  # the faults and start gate each launch's environment plans (`tests.faults.node`)
PER_RANK_BATCH = 2
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *diloco("train")[1:]]
COMMON = [
    "model.preset=tiny", "data.max_bytes=200000", "inner.seq_len=32", "inner.warmup_steps=2", "inner.lr=0.003",
    "outer.inner_steps=4", "inner.total_steps=12", "train.eval_batches=1", "train.num_threads=1",
    "data.order_key=fsdp-test", "train.device=cpu",  # gloo: on a GPU machine too (CUDA FSDP needs a GPU per rank)
]


def _overrides(batch: int, rounds: int) -> list[str]:
    return COMMON + [f"inner.batch_size={batch}", f"train.max_rounds={rounds}"]


def _launch(procs: Procs, run_dir: Path, overrides: list[str], env_extra: dict[str, str] | None = None) -> Proc:
    args = [*ENTRY, "--nproc-per-node", "2", *set_args(overrides), "--run-dir", str(run_dir)]
    return procs.start(args, run_dir.with_name(f"{run_dir.name}.log"), env_extra)


def _one_rank_node(run_dir: Path, rounds: int) -> Node:
    config = load_config(None, _overrides(2 * PER_RANK_BATCH, rounds))
    return Node(config, run_dir, progress=False)


def _ckpt(run_dir: Path, round_: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"round-{round_:06d}.safetensors"))


def _assert_same_state(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """θ, momentum and every AdamW tensor, at fp32 reordering tolerance."""
    assert sorted(ours) == sorted(ref)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1-rank reference (rounds 1-3, and a copy of its dir at round 2) and a 2-rank run (rounds 1-2).

    The 2-rank nodes of the tests below start here too, at once, and run while the reference
    trains in this process (each is a launcher and two ranks that spend their first seconds
    importing torch; one after the other they took a minute): under torchrun (rounds 1-2), one
    resuming the reference's round 2 (round 3), and one whose rank 1 is killed at its second
    step. Each test waits for its own."""
    root = tmp_path_factory.mktemp("fsdp")
    with Procs() as procs:
        two = _launch(procs, root / "two", _overrides(PER_RANK_BATCH, 2))
        torchrun = procs.start([*TORCHRUN, *set_args(_overrides(PER_RANK_BATCH, 2)), "--run-dir", str(root / "torchrun")],
                               root / "torchrun.log")
        dead = _launch(procs, root / "dead", _overrides(PER_RANK_BATCH, 2), {"DILOCO_P2P_FAULTS": "kill@rank1.step:2"})
        dead.watch()  # its test asserts how soon after the kill it stopped
        ref = root / "ref"
        _one_rank_node(ref, 2).run()
        shutil.copytree(ref, root / "ref_at_2")
        shutil.copytree(root / "ref_at_2", root / "resumed")
        resumed = _launch(procs, root / "resumed", _overrides(PER_RANK_BATCH, 3))
        _one_rank_node(ref, 3).run()
        assert two.wait(timeout=150) == 0, two.output()
        yield {"ref": ref, "ref_at_2": root / "ref_at_2", "two": root / "two", "two_stderr": two.output(),
               "root": root, "torchrun": torchrun, "resumed": resumed, "dead": dead}


@pytest.mark.timeout(240)
def test_two_ranks_train_like_one_rank_with_twice_the_batch(runs):
    import json

    assert "sharded over 2 local ranks" in runs["two_stderr"]
    for round_ in (1, 2):
        _assert_same_state(_ckpt(runs["two"], round_), _ckpt(runs["ref_at_2"], round_))  # keeps rounds 1-2
    two = [json.loads(line) for line in (runs["two"] / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (runs["ref"] / "metrics.jsonl").read_text().splitlines()][:3]
    assert [r["round"] for r in two] == [0, 1, 2]
    assert [r["tokens"] for r in two] == [r["tokens"] for r in ref]  # node tokens = sum over ranks
    for a, b in zip(two[1:], ref[1:], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)  # mean over ranks
    meta = json.loads((runs["two"] / "checkpoints" / "round-000002.json").read_text())
    ref_meta = json.loads((runs["ref_at_2"] / "checkpoints" / "round-000002.json").read_text())
    assert meta["inner"] == ref_meta["inner"] and meta["data_position"] == ref_meta["data_position"]
    assert meta["local_world_size"] == 2


@pytest.mark.timeout(180)
def test_torchrun_runs_the_same_two_rank_node(runs):
    run_dir, proc = runs["root"] / "torchrun", runs["torchrun"]
    assert proc.wait(timeout=150) == 0, proc.output()
    assert "sharded over 2 local ranks" in proc.output()
    for round_ in (1, 2):
        _assert_same_state(_ckpt(run_dir, round_), _ckpt(runs["two"], round_))


def test_two_rank_checkpoint_resumes_in_a_one_rank_node(runs, tmp_path):
    run_dir = tmp_path / "resumed"
    shutil.copytree(runs["two"], run_dir)
    node = _one_rank_node(run_dir, 3)
    full = _ckpt(runs["two"], 2)
    assert node.round == 2 and node.step == 8
    assert torch.equal(node.outer.theta, full["outer.theta"])  # the full θ, bit for bit
    assert torch.equal(node.outer.momentum, full["outer.momentum"])
    node.run()
    _assert_same_state(_ckpt(run_dir, 3), _ckpt(runs["ref"], 3))  # and it trains on as the 1-rank run did


def test_two_rank_checkpoint_exports_a_normal_transformers_model(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from diloco_p2p.ops.transfer import export, find_checkpoint, model_from_checkpoint

    export(runs["two"], tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    config, ckpt = find_checkpoint(runs["two"])
    assert ckpt.meta["local_world_size"] == 2
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, model_from_checkpoint(config, ckpt).eval()(tokens).logits)


@pytest.mark.timeout(180)
def test_one_rank_checkpoint_resumes_in_a_two_rank_node(runs):
    run_dir, proc = runs["root"] / "resumed", runs["resumed"]  # a copy of ref_at_2, resumed by 2 ranks
    assert proc.wait(timeout=150) == 0, proc.output()
    err = proc.output()
    assert "resumed from checkpoint at round 2 (step 8; written by 1 local rank(s))" in err
    _assert_same_state(_ckpt(run_dir, 3), _ckpt(runs["ref"], 3))


OVERLAP_CASES = [("eager", 1), ("inner", 1), ("inner", 2)]


def _overlap_settings(mode: str, fragments: int) -> list[str]:
    settings = [f"sync.overlap={mode}", "sync.overlap_steps=2"]
    if fragments > 1:
        settings += [f"sync.fragments={fragments}", "sync.overlap_merge=rebase"]
    return settings


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    """Per case of the test below: the 1-rank reference trained in this process (3 rounds, its
    run dir copied at round 1 as `two`), and the 2-rank node resuming that copy, started at once
    so that it runs while the next case's reference trains. Each test waits for its own."""
    root = tmp_path_factory.mktemp("overlap")
    with Procs() as procs:
        started = {}
        for mode, fragments in OVERLAP_CASES:
            case, eager = root / f"{mode}-{fragments}", _overlap_settings(mode, fragments)
            ref, two = case / "ref", case / "two"
            node = Node(load_config(None, _overrides(2 * PER_RANK_BATCH, 3) + eager), ref, progress=False)
            save = node._save

            def save_and_copy_round_1(node=node, save=save, ref=ref, two=two) -> None:
                save()
                if node.round == 1:
                    shutil.copytree(ref, two)

            node._save = save_and_copy_round_1
            node.run()
            started[mode, fragments] = case, _launch(procs, two, _overrides(PER_RANK_BATCH, 3) + eager)
        yield started


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode,fragments", OVERLAP_CASES)
def test_two_ranks_under_overlap_train_like_one_rank(overlap_runs, mode, fragments):
    """sync.overlap on 2 ranks, each pipelining its shard: it resumes a 1-rank node's round 1 (a round
    in flight and, eager, a local correction, sliced per rank), averages that round again behind round
    2 (inner: lands it 2 steps in, on every rank at once), and drains in round 3. Every checkpoint
    (the Δ in flight and the correction gathered into the 1-rank layout) matches the 1-rank node with
    twice the batch, and a 1-rank node resumes its round 2 and ends round 3 as that node did. With
    sync.fragments=2 (and the rebase merge) each rank averages its shard's values of the round's
    half, and the checkpoints also hold the trained weights."""
    eager = _overlap_settings(mode, fragments)
    case, proc = overlap_runs[mode, fragments]
    ref, two, back = case / "ref", case / "two", case / "back"
    assert proc.wait(timeout=150) == 0, proc.output()
    assert "sharded over 2 local ranks" in proc.output()
    kept = {"overlap.theta", "overlap.inflight_delta"} if mode == "eager" else {"overlap.inflight_delta"}
    kept |= {"fragments.local"} if fragments > 1 else set()
    assert kept <= set(_ckpt(two, 2))  # round 2 in flight at its end
    for round_ in (2, 3):
        _assert_same_state(_ckpt(two, round_), _ckpt(ref, round_))
    records = read_records(two)[-2:]
    assert [(r["round"], r["applied_round"], r["overlap"]) for r in records] == [(2, 1, mode), (3, 3, mode)]
    assert [r.get("landed_step") for r in records] == ([None, None] if mode == "eager" else [2, 2])
    assert [r.get("fragment") for r in records] == ([1, 0] if fragments > 1 else [None, None])
    shutil.copytree(two, back)
    Node(load_config(None, _overrides(2 * PER_RANK_BATCH, 3) + eager + ["train.resume_round=2"]), back,
         progress=False).run()
    _assert_same_state(_ckpt(back, 3), _ckpt(ref, 3))


@pytest.mark.timeout(180)
def test_a_dead_local_rank_stops_the_node_within_a_bound(runs):
    """SIGKILL rank 1 at its second inner step: the launcher must name it, stop rank 0 (blocked
    in an FSDP all-gather), and exit within a bound, leaving no rank behind."""
    proc = runs["dead"]
    rc = proc.wait(timeout=150)
    _assert_rank_death_handled(proc, rc)


def _assert_rank_death_handled(proc: Proc, rc: int) -> None:
    text = proc.output()
    fired = proc.first("fault injection: kill at rank1.step")
    assert fired is not None, text
    assert rc == 128 + signal.SIGKILL, text
    errors = [line for _, line in proc.lines if line.startswith("error: local rank 1 ")]
    assert errors == ["error: local rank 1 of 2 was killed by SIGKILL; stopping the node (1 other rank(s) terminated)\n"]
    assert proc.ended is not None and proc.ended - fired < 20, f"the node took {proc.ended - fired:.1f}s to stop"
    assert "Traceback" not in text, text
    pids = [int(p) for p in re.findall(r"started local rank \d of 2 \(pid (\d+)\)", text)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- in a swarm: each local rank averages its shard with the same shard of the other nodes -------


def _swarm_overrides(seed_addr: str, name: str) -> list[str]:
    return COMMON + [
        "run_id=fsdp-swarm", f"data.order_key=node-{name}", f"inner.batch_size={PER_RANK_BATCH}",
        "train.max_rounds=1000", "sync.min_group_size=2", "sync.target_group_size=2", "sync.matchmaking_timeout=12",
        "sync.allreduce_timeout=30", "sync.state_timeout=60", "sync.compression=fp32", "p2p.host_maddrs=['/ip4/127.0.0.1/tcp/0']",
        "p2p.connect_timeout=60", f"p2p.initial_peers=['{seed_addr}']",
    ]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """One story on loopback: nodes A and B (2 ranks each) train together; rank 1 of B is killed in
    round 3; A trains on alone; a 1-rank node C is refused; a 2-rank node D joins A; SIGTERM stops
    A and D."""
    root = tmp_path_factory.mktemp("swarm")
    with ProcessSwarm(root) as swarm:
        procs, addr = swarm.procs, swarm.maddr
        gate = {"DILOCO_P2P_START_GATE": str(root / "gate")}  # A's and B's rounds start together
        a = _launch(procs, root / "a", _swarm_overrides(addr, "a"), gate)
        b = _launch(procs, root / "b", _swarm_overrides(addr, "b"), {**gate, "DILOCO_P2P_FAULTS": "kill@rank1.step:10"})
        wait_until(lambda: len(list(root.glob("gate.ready-*"))) == 4, 180, "both ranks of A and B to join", a, b)
        (root / "gate").touch()
        b_rc = b.wait(timeout=300)
        # A goes on: its round 3 ends alone once matchmaking gives up on B.
        wait_until(lambda: any(r["round"] >= 3 and r["status"] == "alone" for r in read_records(root / "a")), 120,
                   "A trains on without B", a)
        c = procs.start(diloco("train", *set_args(_swarm_overrides(addr, "c") + ["inner.batch_size=4"]),
                               "--run-dir", str(root / "c")), root / "c.log")
        d = _launch(procs, root / "d", _swarm_overrides(addr, "d"))
        wait_until(lambda: c.first("error:") is not None, 180, "C is refused", c)
        c_rc = c.exit_code_within(20)  # None: refused but did not exit, and the test below fails on it
        c.kill()

        def d_agreed() -> bool:
            recs = read_records(root / "d")
            joined = [i for i, r in enumerate(recs) if r["status"] == "resynced"]
            return bool(joined) and any(r["status"] == "committed" for r in recs[joined[0]:])

        wait_until(d_agreed, 240, "D joins and commits a round with A", a, d)
        stopped = time.monotonic()
        a.signal(signal.SIGTERM)
        d.signal(signal.SIGTERM)
        a_rc, d_rc = a.wait(timeout=90), d.wait(timeout=90)
        yield {"root": root, "a": a, "b": b, "c": c, "d": d, "b_rc": b_rc, "c_rc": c_rc, "a_rc": a_rc, "d_rc": d_rc,
               "stopped": stopped}


def _reference_two_one_rank_nodes(tmp_path: Path, rounds: int) -> list[dict[str, torch.Tensor]]:
    """Two 1-rank nodes (batch 2b) averaging their full Δ in fp32, computed in this process."""
    nodes = []
    for name in ("a", "b"):
        config = load_config(None, COMMON + [f"data.order_key=node-{name}", f"inner.batch_size={2 * PER_RANK_BATCH}",
                                             "train.max_rounds=1000"])
        nodes.append(Node(config, tmp_path / name, progress=False))
    states = []
    for _ in range(rounds):
        deltas, weights = [], []
        for n in nodes:
            n.outer.copy_into(n.params)
            tokens = sum(n.trainer.step(lambda n=n: n.data.next_batch(2 * PER_RANK_BATCH)).tokens
                         for _ in range(n.config.outer.inner_steps))
            deltas.append(n.outer.pseudo_gradient(n.params))
            weights.append(float(tokens))
        average = sum(w * d for w, d in zip(weights, deltas, strict=True)) / sum(weights)
        for n in nodes:
            n.outer.step(average)
        states.append({k: v.clone() for k, v in nodes[1].outer.state_tensors().items()})
    return states


@pytest.mark.timeout(600)
def test_two_nodes_of_two_ranks_average_like_two_nodes_of_one_rank(swarm, tmp_path):
    a, b = read_records(swarm["root"] / "a"), read_records(swarm["root"] / "b")
    for round_ in (1, 2):
        ra, rb = a[round_], b[round_]
        assert ra["round"] == rb["round"] == round_
        assert ra["status"] == rb["status"] == "committed" and ra["group_size"] == rb["group_size"] == 2
        assert ra["shards_committed"] == 2 and ra["params_sha256"] == rb["params_sha256"]
    reference = _reference_two_one_rank_nodes(tmp_path, 2)
    for round_ in (1, 2):
        ours = _ckpt(swarm["root"] / "b", round_)
        for name, ref in reference[round_ - 1].items():
            # Same windows by construction; FSDP sums gradients in another order than one rank, and
            # AdamW's g/sqrt(v) magnifies that rounding where a gradient is tiny (2 of 382k values
            # differ by 2.6e-5 on the keyed Feistel data order).
            torch.testing.assert_close(ours[name], ref, rtol=1e-4, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_killing_a_local_rank_stops_its_node_and_the_swarm_carries_on(swarm):
    _assert_rank_death_handled(swarm["b"], swarm["b_rc"])
    a = read_records(swarm["root"] / "a")
    assert [r["status"] for r in a[1:3]] == ["committed", "committed"]
    assert a[3]["status"] == "alone" and a[3]["round"] == 3


def test_a_node_with_another_local_world_size_is_refused(swarm):
    text = swarm["c"].output()
    assert swarm["c_rc"] == 2, text  # exits within 20 s of its error line
    refusal = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and "local_world_size" in refusal[0], text
    assert "Traceback" not in text


def test_a_two_rank_node_joins_and_agrees_after_one_round(swarm):
    a = {r["round"]: r for r in read_records(swarm["root"] / "a")}
    d = read_records(swarm["root"] / "d")
    joined = next(i for i, r in enumerate(d) if r["status"] == "resynced")
    assert d[joined]["joined_at_round"] == d[joined]["round"] >= 3
    after = next(r for r in d[joined + 1:] if r["status"] == "committed")
    assert after["group_size"] == 2 and after["shards_committed"] == 2
    assert a[after["round"]]["status"] == "committed" and a[after["round"]]["params_sha256"] == after["params_sha256"]


def test_sigterm_stops_a_swarm_node_of_two_ranks_cleanly(swarm):
    import json

    for name in ("a", "d"):
        proc = swarm[name]
        assert swarm[f"{name}_rc"] == 0, proc.output()
        assert proc.ended - swarm["stopped"] < 60, f"{name} took {proc.ended - swarm['stopped']:.0f}s to stop"
        latest = json.loads((swarm["root"] / name / "checkpoints" / "latest.json").read_text())["meta"]
        saved = json.loads((swarm["root"] / name / "checkpoints" / latest).read_text())
        assert saved["round"] == read_records(swarm["root"] / name)[-1]["round"]


# -- fragments on nodes of 2 ranks: each rank averages its shard's values of the round's part ------

FRAGMENT_ROUNDS = 4


@pytest.fixture(scope="module")
def fragment_swarm(tmp_path_factory):
    """Two 2-rank nodes with `sync.fragments=2` under `inner` with `rebase` (the recipe of
    docs/recipes.md): every round averages half of the parameters, each local rank the values
    of that half its shard holds (`ShardLayout.local_range`) with the same rank of the other node."""
    root = tmp_path_factory.mktemp("fsdp-fragments")
    with ProcessSwarm(root) as swarm:
        gate = {"DILOCO_P2P_START_GATE": str(root / "gate")}
        extra = ["sync.fragments=2", "sync.overlap=inner", "sync.overlap_steps=1", "sync.overlap_merge=rebase",
                 f"train.max_rounds={FRAGMENT_ROUNDS}"]
        nodes = {name: _launch(swarm.procs, root / name, [*_swarm_overrides(swarm.maddr, name), *extra], gate)
                 for name in ("a", "b")}
        wait_until(lambda: len(list(root.glob("gate.ready-*"))) == 4, 180, "both ranks of A and B to join",
                   *nodes.values())
        (root / "gate").touch()
        for proc in nodes.values():
            assert proc.wait(timeout=300) == 0, proc.output()
        yield {name: {r["round"]: r for r in read_records(root / name)} for name in nodes}


def test_two_rank_nodes_average_fragments_shard_by_shard_and_agree_every_round(fragment_swarm):
    a, b = fragment_swarm["a"], fragment_swarm["b"]
    for round_ in range(FRAGMENT_ROUNDS + 1):
        assert a[round_]["params_sha256"] == b[round_]["params_sha256"], f"round {round_}"
    for records in (a, b):
        assert [records[r]["fragment"] for r in range(1, FRAGMENT_ROUNDS + 1)] == [0, 1, 0, 1]  # its half
        landings = [records[r] for r in range(2, FRAGMENT_ROUNDS + 1)]  # round r records round r-1's landing
        assert all(r["status"] == "committed" and r["group_size"] == 2 and r["shards_committed"] == 2
                   for r in landings)
        assert [r["landed_step"] for r in landings] == [1] * (FRAGMENT_ROUNDS - 1)  # τ = 1
        assert [r["applied_round"] for r in landings] == [1, 2, FRAGMENT_ROUNDS]  # the last lands at the stop
    hashes = [a[r]["params_sha256"] for r in range(FRAGMENT_ROUNDS + 1)]
    assert hashes[1] == hashes[0] and len(set(hashes[1:])) == FRAGMENT_ROUNDS  # every landing moved θ
