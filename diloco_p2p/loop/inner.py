"""The inner optimizer: AdamW (or Muon) steps on this node's own data.

Warmup + cosine over the whole run, global-norm clipping, gradient accumulation, bf16 autocast
on CUDA. The optimizer state persists across rounds (DiLoCo resets only the parameters to θ);
on N local ranks it is FSDP-sharded and loss and tokens are made node-wide. ``inner.optimizer:
muon`` is MuLoCo (Thérien et al. 2025, arXiv:2505.23725): Muon on the hidden 2-D matrices
(`muon_split`), AdamW on the rest, its update matched to AdamW's RMS so lr and weight decay carry
over. The choice is per node; on several ranks each FSDP-sharded matrix is orthogonalized whole
(`diloco_p2p.local.muon`).
Why these choices: docs/architecture.md, "The inner optimizer".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch

from diloco_p2p.config import InnerConfig
from diloco_p2p.errors import UserError
from diloco_p2p.faults import Faults
from diloco_p2p.local.fsdp import is_dtensor, reshard
from diloco_p2p.local.muon import ShardedMuon
from diloco_p2p.local.ranks import Ranks


def warmup_cosine(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def muon_split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's, AdamW's) parameters: the 2-D weight matrices of the hidden layers, and the rest
    (input and output embeddings, whether tied or not; norms, biases)."""
    io = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    head = getattr(model, "get_output_embeddings", lambda: None)()
    io += [head] if head is not None else []
    outside = {id(p) for m in io for p in m.parameters()}
    params = list(model.parameters())
    hidden = [p for p in params if p.ndim == 2 and id(p) not in outside]
    chosen = {id(p) for p in hidden}
    return hidden, [p for p in params if id(p) not in chosen]


class StepStats:
    """One inner step's node-wide loss and tokens. On one GPU rank the loss comes back through pinned
    memory and an event and is read one step late, so the GPU never idles between steps."""

    def __init__(self, tokens: int, loss: float | None = None, pending: tuple | None = None):
        self.tokens, self._loss, self._pending = tokens, loss, pending

    @property
    def loss(self) -> float:
        if self._loss is None:
            host, ready = self._pending
            ready.synchronize()
            self._loss, self._pending = float(host), None
        return self._loss


class InnerTrainer:
    """AdamW (under ``inner.optimizer=muon``: Muon and AdamW) with its schedule. Fault point for
    tests: ``rank{R}.step:{S}`` fires on local rank R before global inner step S (`diloco_p2p.faults`)."""

    def __init__(self, model: torch.nn.Module, cfg: InnerConfig, total_steps: int, device: torch.device,
                 precision: str = "auto", ranks: Ranks | None = None, faults: Faults | None = None):
        self.model, self.cfg, self.device = model, cfg, device
        self.ranks, self.faults = ranks or Ranks(device), faults or Faults()
        dtensors = any(is_dtensor(p) for p in model.parameters())  # FSDP's, on N ranks (or 1 in tests)
        hidden, rest = muon_split(model) if cfg.optimizer == "muon" else ([], list(model.parameters()))
        decay = [p for p in rest if p.ndim >= 2]
        no_decay = [p for p in rest if p.ndim < 2]
        # One fused kernel for the whole update on a GPU (FSDP's DTensor parameters keep foreach).
        fused = device.type == "cuda" and not dtensors
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None,
        )
        factor = warmup_cosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.muon: torch.optim.Muon | None = None
        self.muon_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if cfg.optimizer == "muon":
            muon = ShardedMuon if dtensors else torch.optim.Muon  # FSDP's row shards: each matrix whole
            self.muon = muon(hidden, lr=cfg.muon_lr or cfg.lr, weight_decay=cfg.weight_decay,
                             momentum=cfg.muon_momentum, nesterov=True, adjust_lr_fn="match_rms_adamw")
            self.muon_scheduler = torch.optim.lr_scheduler.LambdaLR(self.muon, factor)
        use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
        self._autocast = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext
        )

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned: the copy does not wait for the GPU to drain first
            batch = batch.pin_memory()
        batch = batch.to(self.device, non_blocking=True)
        with self._autocast():
            logits = self.model(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def step(self, next_batch: Callable[[], torch.Tensor]) -> StepStats:
        """One optimizer step over `grad_accum` micro-batches; loss and tokens are the node's."""
        self.faults.fire(f"rank{self.ranks.rank}.step", self.scheduler.last_epoch + 1)
        self.model.train()
        total = torch.zeros((), device=self.device)
        tokens = 0
        for _ in range(self.cfg.grad_accum):
            batch = next_batch()
            loss = self._loss(batch) / self.cfg.grad_accum
            loss.backward()
            total += loss.detach()
            tokens += batch[:, 1:].numel()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        for optimizer, scheduler in self._stepped():
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda" and not self.ranks.sharded:  # read later (`StepStats`)
            host = torch.empty((), dtype=torch.float32, pin_memory=True)
            host.copy_(total, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            return StepStats(tokens, pending=(host, ready))
        # float() is a device sync point, once per step; on N ranks so is the all-reduce.
        loss_sum, node_tokens = self.ranks.all_reduce([float(total), float(tokens)])
        return StepStats(int(node_tokens), loss=loss_sum / self.ranks.world_size)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float | None:
        if not batches:
            return None
        self.model.eval()
        losses = [float(self._loss(b)) for b in batches]
        reshard(self.model)  # on N ranks: the next forward reads θ from the shards again (`fsdp.reshard`)
        return sum(losses) / len(losses)

    def _stepped(self) -> list[tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]]:
        pairs = [(self.optimizer, self.scheduler)]
        return pairs + ([(self.muon, self.muon_scheduler)] if self.muon is not None else [])

    @property
    def lr(self) -> float:
        """AdamW's current lr (Muon's, under muon, is ``inner.muon_lr / inner.lr`` times it)."""
        return self.scheduler.get_last_lr()[0]

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Each optimizer by its key in `state_dict`: ``optimizer`` (AdamW), and ``muon`` under muon."""
        return {"optimizer": self.optimizer, **({"muon": self.muon} if self.muon is not None else {})}

    def state_dict(self) -> dict:
        """Under adamw the same keys as before Muon existed (older checkpoints stay resumable)."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.muon is not None:
            state |= {"muon": self.muon.state_dict(), "muon_scheduler": self.muon_scheduler.state_dict()}
        return state

    def check_state(self, state: dict, where: str = "the inner state") -> None:
        """`UserError` if `state` was written under the other ``inner.optimizer``."""
        written = "muon" if "muon" in state else "adamw"
        if written != self.cfg.optimizer:
            raise UserError(f"{where} holds inner.optimizer={written} state, this node runs "
                            f"{self.cfg.optimizer}; resume with --set inner.optimizer={written}")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.muon is not None:
            self.muon.load_state_dict(state["muon"])
            self.muon_scheduler.load_state_dict(state["muon_scheduler"])
