"""Getting a model out of the swarm: `diloco-p2p fetch` and `diloco-p2p export`.

`fetch` joins the DHT as a client, downloads the newest global state a node serves (θ, outer
momentum, round; verified against the donor's announced sha256 and against the swarm's majority
params hash for that round) and writes it as a normal run directory: `config.yaml` rebuilt from
the swarm's config view, and a checkpoint. `train --run-dir` resumes from it (with a fresh
inner optimizer) and `export` reads it.

`export` writes the checkpoint's θ as a transformers model (`save_pretrained`, safetensors) with
its tokenizer, so `AutoModelForCausalLM.from_pretrained(out)` gives the same logits as the node.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diloco_p2p.config import Config, apply_override, config_fields, load_config, save_config, validate_config
from diloco_p2p.errors import UserError
from diloco_p2p.hashing import tensor_sha256
from diloco_p2p.loop.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from diloco_p2p.loop.outer import OuterOptimizer
from diloco_p2p.model.build import build_model, build_tokenizer, save_pretrained

log = logging.getLogger(__name__)


def fetch(initial_peers: Sequence[str], run_id: str, out: Path, timeout: float = 60.0) -> Checkpoint:
    """Download and verify the swarm's newest state into the run directory `out`."""
    from diloco_p2p.config import P2PConfig
    from diloco_p2p.ops.status import CLIENT_HOST_MADDRS
    from diloco_p2p.swarm.membership.records import read_progress_async
    from diloco_p2p.swarm.membership.resync import majority
    from diloco_p2p.swarm.state.client import StateUnavailable, fetch_state
    from diloco_p2p.swarm.state.codec import unpack_state
    from diloco_p2p.swarm.transport.dht import start_dht
    from diloco_p2p.swarm.transport.runner import BackgroundLoop

    if (out / "checkpoints" / "latest.json").exists():
        raise UserError(f"--out {out} already holds a checkpoint; pick an empty directory")
    cfg = P2PConfig(initial_peers=list(initial_peers), host_maddrs=CLIENT_HOST_MADDRS, connect_timeout=timeout)
    dht = start_dht(cfg, None, client_mode=True)
    loop = BackgroundLoop()
    try:
        p2p = loop.run(dht.replicate_p2p(), timeout=30)
        records = loop.run(read_progress_async(dht, run_id, timeout=timeout))
        if not records:
            raise UserError(f"no node of run {run_id!r} is in the DHT; check --run-id and --initial-peers")
        try:
            fetched = loop.run(fetch_state(dht, p2p, run_id=run_id, timeout=timeout, wait=min(timeout, 10.0)))
        except StateUnavailable as e:
            raise UserError(f"could not download the state of run {run_id!r}: {e}") from None
        loop.run(p2p.shutdown(), timeout=10)
    finally:
        loop.close()
        dht.shutdown()

    tensors, meta = unpack_state(fetched.blob)
    round_ = int(meta["round"])
    theta_hash = tensor_sha256(tensors["outer.theta"])
    same_round = [r.params_sha256 for r in records.values() if r.round == round_]
    if theta_hash != meta.get("params_sha256") or (same_round and majority(same_round) != theta_hash):
        raise UserError(f"the state of round {round_} from {fetched.donor} does not match the swarm's params hash; "
                        "try again to reach another node")
    view = next(r.view() for r in records.values() if r.config_hash == meta.get("config_hash"))
    config = config_from_view(view)
    out.mkdir(parents=True, exist_ok=True)
    save_config(config, out / "config.yaml")
    ckpt = Checkpoint(round=round_, step=0, tokens=0, tensors=tensors, meta={
        "swarm_view": config.swarm_view(), "config_hash": config.swarm_hash(), "params_sha256": theta_hash,
        "fetched_from": fetched.donor, "joined_at_round": round_,
    })
    save_checkpoint(out / "checkpoints", ckpt)
    log.info("fetched round %d of run %r (%.2f MB from %s in %.1f s) into %s", round_, run_id,
             fetched.bytes / 1e6, fetched.donor, fetched.seconds, out)
    return ckpt


def fetch_dataset(initial_peers: Sequence[str], dataset: str, out: Path, timeout: float = 60.0,
                  parallel: int = 4) -> dict[str, Any]:
    """Download dataset `dataset` (manifest and every shard, each verified) from the swarm into
    `out`, resuming what an earlier run left; `out` is then an ordinary prepared corpus."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from diloco_p2p.config import P2PConfig
    from diloco_p2p.data.cache import CACHE_MARKER, ShardCache, ShardUnavailable, load_or_fetch_manifest
    from diloco_p2p.ops.status import CLIENT_HOST_MADDRS
    from diloco_p2p.swarm.datashare import DataShare
    from diloco_p2p.swarm.transport.dht import start_dht
    from diloco_p2p.swarm.transport.runner import BackgroundLoop

    cfg = P2PConfig(initial_peers=list(initial_peers), host_maddrs=CLIENT_HOST_MADDRS, connect_timeout=timeout)
    dht = start_dht(cfg, None, client_mode=True)
    loop = BackgroundLoop()
    try:
        p2p = loop.run(dht.replicate_p2p(), timeout=30)
        share = DataShare(dht, p2p, loop, serving=False)
        start = time.perf_counter()
        manifest = load_or_fetch_manifest(out, dataset, share, timeout)
        cache = ShardCache(manifest, share, fetch_timeout=timeout)
        with ThreadPoolExecutor(parallel, thread_name_prefix="fetch-data") as pool:
            try:
                list(pool.map(cache.ensure, range(len(manifest.shards))))
            except ShardUnavailable as e:
                raise UserError(f"{e}; run the same fetch-data again to resume") from None
        seconds = time.perf_counter() - start
        loop.run(p2p.shutdown(), timeout=10)
    finally:
        loop.close()
        dht.shutdown()
    (out / CACHE_MARKER).unlink(missing_ok=True)  # whole now: trained on like any prepared corpus
    return {"shards": len(manifest.shards), "bytes": cache.fetched_bytes, "seconds": seconds,
            "mb_per_s": cache.fetched_bytes / 1e6 / seconds if seconds > 0 else 0.0}


def config_from_view(view: dict[str, Any]) -> Config:
    """A config holding the swarm's fields (dotted paths, as in a progress record); defaults elsewhere."""
    tree: dict[str, Any] = {}
    for path, value in config_fields(view).items():
        apply_override(tree, path.split("."), value)
    return validate_config(tree, source="the swarm's config view")


def find_checkpoint(path: Path) -> tuple[Config, Checkpoint]:
    """The config and latest checkpoint of a run directory (or of its `checkpoints/` folder)."""
    run_dir = path.parent if path.name == "checkpoints" else path
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"--checkpoint {path}: no config.yaml in {run_dir}; point it at a run directory")
    config = load_config(config_path)
    ckpt = load_checkpoint(run_dir / "checkpoints", config.swarm_view())
    if ckpt is None:
        raise UserError(f"--checkpoint {path}: no checkpoint in {run_dir / 'checkpoints'}")
    return config, ckpt


def model_from_checkpoint(config: Config, ckpt: Checkpoint) -> torch.nn.Module:
    """The model with the checkpoint's global parameters θ."""
    tokenizer = build_tokenizer(config.model)
    model = build_model(config.model, tokenizer.vocab_size, config.seed)
    params = list(model.parameters())
    outer = OuterOptimizer(params, config.outer)
    outer.load_state_tensors(ckpt.tensors)
    outer.copy_into(params)
    return model


def export(checkpoint: Path, out: Path) -> Path:
    """Write `checkpoint`'s model and tokenizer to `out` in the transformers format."""
    config, ckpt = find_checkpoint(checkpoint)
    model = model_from_checkpoint(config, ckpt)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)
    build_tokenizer(config.model).save(out)
    log.info("exported round %d (params %s) to %s", ckpt.round, ckpt.meta.get("params_sha256", "?")[:12], out)
    return out
