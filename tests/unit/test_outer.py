import hashlib

import pytest
import torch

from diloco_p2p import hashing
from diloco_p2p.config import OuterConfig
from diloco_p2p.config.schedule import dylu_steps
from diloco_p2p.hashing import tensor_sha256
from diloco_p2p.loop.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from diloco_p2p.loop.outer import OuterOptimizer, flatten


def _workers(theta: torch.Tensor, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [theta + torch.randn(theta.shape, generator=g) for _ in range(n)]


def _round(outer: OuterOptimizer, locals_: list[torch.Tensor], sign: float = 1.0) -> None:
    deltas = [sign * outer.pseudo_gradient([w]) for w in locals_]
    outer.step(torch.stack(deltas).mean(0))


def test_lr1_momentum0_is_parameter_averaging():
    theta = torch.randn(50)
    outer = OuterOptimizer([theta], OuterConfig(lr=1.0, momentum=0.0, nesterov=True))
    workers = _workers(theta, 4)
    _round(outer, workers)
    torch.testing.assert_close(outer.theta, torch.stack(workers).mean(0), rtol=0, atol=1e-6)


def test_lr0_is_a_noop():
    theta = torch.randn(50)
    outer = OuterOptimizer([theta], OuterConfig(lr=0.0, momentum=0.9))
    _round(outer, _workers(theta, 3))
    assert torch.equal(outer.theta, theta)


def test_matches_torch_sgd_nesterov_applied_by_hand():
    shapes = [(4, 3), (7,)]
    params = [torch.randn(s) for s in shapes]
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterOptimizer(params, cfg)
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    sgd = torch.optim.SGD(reference, lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        local = [p + 0.1 * torch.randn(p.shape, generator=g) for p in reference]
        delta = outer.pseudo_gradient(local)
        for p, d in zip(reference, delta.split([p.numel() for p in reference]), strict=True):
            p.grad = d.view(p.shape).clone()  # pseudo-gradient as the gradient
        sgd.step()
        outer.step(delta)
        torch.testing.assert_close(outer.theta, flatten(reference), rtol=0, atol=1e-6)


def test_plain_momentum_without_nesterov_matches_torch():
    p = torch.randn(10)
    outer = OuterOptimizer([p], OuterConfig(lr=0.5, momentum=0.8, nesterov=False))
    ref = torch.nn.Parameter(p.clone())
    sgd = torch.optim.SGD([ref], lr=0.5, momentum=0.8, nesterov=False)
    for k in range(3):
        local = ref.detach() + torch.full_like(p, 0.1 * (k + 1))
        delta = outer.pseudo_gradient([local])
        ref.grad = delta.clone()
        sgd.step()
        outer.step(delta)
    torch.testing.assert_close(outer.theta, ref.detach(), rtol=0, atol=1e-6)


def test_flipped_sign_moves_away_from_workers_mean():
    theta = torch.zeros(100)
    workers = _workers(theta, 4, seed=3)
    mean = torch.stack(workers).mean(0)
    right = OuterOptimizer([theta], OuterConfig(lr=0.7, momentum=0.9))
    wrong = OuterOptimizer([theta], OuterConfig(lr=0.7, momentum=0.9))
    _round(right, workers)
    _round(wrong, workers, sign=-1.0)
    start = (theta - mean).norm()
    assert (right.theta - mean).norm() < start
    assert (wrong.theta - mean).norm() > start


def test_non_finite_average_is_refused():
    outer = OuterOptimizer([torch.zeros(3)], OuterConfig())
    bad = torch.tensor([0.0, float("nan"), 1.0])
    try:
        outer.step(bad)
    except ValueError as e:
        assert "not finite" in str(e)
    else:
        raise AssertionError("a NaN average reached the outer step")
    assert torch.isfinite(outer.theta).all()


def test_momentum_survives_save_and_load(tmp_path):
    p = torch.randn(20)
    cfg = OuterConfig(lr=0.7, momentum=0.9)
    a = OuterOptimizer([p], cfg)
    workers = _workers(p, 2)
    _round(a, workers)
    save_checkpoint(tmp_path, Checkpoint(round=1, step=0, tokens=0, tensors=a.state_tensors()))
    b = OuterOptimizer([torch.zeros(20)], cfg)
    b.load_state_tensors(load_checkpoint(tmp_path).tensors)
    assert torch.equal(a.momentum, b.momentum) and a.momentum.abs().sum() > 0
    more = _workers(a.theta, 2, seed=9)
    _round(a, more)
    _round(b, more)
    assert torch.equal(a.theta, b.theta)


def test_delayed_nesterov_matches_the_worked_example():
    """AsyncDiLoCo's Delayed Nesterov, the review's worked example (MATH ENTRY 4): N=4, β=0.9,
    η=0.7, c=0, θ=[1, 1]; four Δ, SGD on the first three, the Nesterov step on the buffer at the fourth."""
    theta = torch.tensor([1.0, 1.0])
    outer = OuterOptimizer([theta], OuterConfig(lr=0.7, momentum=0.9, delayed_nesterov=4))
    expected = [[0.972, 1.007], [0.951, 0.993], [0.916, 0.9965], [0.7298, 0.9766]]
    deltas = [[0.04, -0.01], [0.03, 0.02], [0.05, -0.005], [0.02, 0.01]]
    for delta, want in zip(deltas, expected, strict=True):
        outer.step(torch.tensor(delta))
        torch.testing.assert_close(outer.theta, torch.tensor(want), rtol=0, atol=6e-5)  # the paper prints 4 decimals
    torch.testing.assert_close(outer.momentum, torch.tensor([0.14, 0.015]), rtol=0, atol=1e-6)
    assert torch.equal(outer.dn_buffer, torch.zeros(2))
    # ordinary Nesterov on the same Δ: a different θ (the check can fail)
    plain = OuterOptimizer([torch.tensor([1.0, 1.0])], OuterConfig(lr=0.7, momentum=0.9))
    for delta in deltas:
        plain.step(torch.tensor(delta))
    assert (plain.theta - outer.theta).abs().max() > 0.03


def test_delayed_nesterov_state_travels_with_theta():
    cfg = OuterConfig(lr=0.7, momentum=0.9, delayed_nesterov=3, dn_momentum_fraction=0.2)
    a = OuterOptimizer([torch.zeros(5)], cfg)
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(5, generator=g) for _ in range(7)]
    for d in steps[:4]:
        a.step(d)
    b = OuterOptimizer([torch.zeros(5)], cfg)
    b.load_state_tensors({k: v.clone() for k, v in a.state_tensors().items()})  # a joiner adopts a's state
    for d in steps[4:]:
        a.step(d)
        b.step(d)
    assert torch.equal(a.theta, b.theta) and a.params_sha256() == b.params_sha256()
    with pytest.raises(ValueError, match="dn_momentum_fraction"):
        OuterConfig(delayed_nesterov=4, dn_momentum_fraction=0.5)


def test_dynamic_local_updates_match_the_worked_example():
    """AsyncDiLoCo's DyLU rule, the review's worked example (MATH ENTRY 6): speeds 100, 80, 60, 50
    steps/s and H=500 give 500, 400, 300, 250 steps."""
    speeds = {"a": 100.0, "b": 80.0, "c": 60.0, "d": 50.0}
    assert [dylu_steps(speeds, w, 500) for w in "abcd"] == [500, 400, 300, 250]
    assert dylu_steps(speeds, "e", 500) == 500  # our speed unknown: H
    assert dylu_steps({"a": 1000.0, "b": 1.0}, "b", 500) == 1  # never zero steps
    assert dylu_steps({"a": 0.0, "b": 0.0}, "a", 30) == 30


def test_theta_hash_is_sha256_of_its_bytes_up_to_one_chunk_and_of_the_chunk_digests_past_it(monkeypatch):
    monkeypatch.setattr(hashing, "HASH_CHUNK_BYTES", 1024)
    small = torch.randn(256)  # exactly one chunk
    assert tensor_sha256(small) == hashlib.sha256(small.numpy().tobytes()).hexdigest()

    big = torch.randn(1000)  # 4000 bytes: chunks of 1024, 1024, 1024, 928
    raw = big.numpy().tobytes()
    digests = b"".join(hashlib.sha256(raw[i : i + 1024]).digest() for i in range(0, len(raw), 1024))
    assert tensor_sha256(big) == hashlib.sha256(hashing._CHUNKED + digests).hexdigest()
    monkeypatch.setattr(hashing.os, "cpu_count", lambda: 1)  # one thread: the same hash
    assert tensor_sha256(big) == hashlib.sha256(hashing._CHUNKED + digests).hexdigest()
    flipped = big.clone()
    flipped[999] = torch.nextafter(flipped[999], torch.tensor(float("inf")))  # last bit of the last chunk
    assert tensor_sha256(flipped) != tensor_sha256(big)


def test_the_trained_weights_come_back_in_one_reused_buffer():
    params = [torch.randn(3, 4), torch.randn(5)]
    outer = OuterOptimizer(params, OuterConfig())
    with torch.no_grad():
        params[0].add_(1.0)
    first = outer.pseudo_gradient(params)
    assert torch.allclose(first, torch.cat([torch.full((12,), -1.0), torch.zeros(5)]))
    staging = outer._staging
    outer.pseudo_gradient(params)
    assert outer._staging is staging and not outer.pinned  # CPU parameters: a plain buffer, once

