"""
The spec, in pytest. First the mathematics each attention variant promises (model.py): dt = 0 is standard
attention, leapfrog is reversible and keeps volume, the closed-form force is the gradient of V, no position sees
the future, the KV cache equals the full forward pass, the parameter budgets. These run in this process.
Then the scripts, run the way a user runs them, each a process of its own started by the small harness that opens
that part: prepare_data.py, train.py and its promises (test_G1_...: no run lost; test_G2_...: exact resume;
test_G3_...: never silently wrong; test_G4_...: one clear line for a plausible mistake), bench.py, and the
repository's pages. The lab's tests live in exercises/test_lab.py, the record's in results/test_results.py; the one
command runs all three.
Run: python -m pytest -q
"""
import ast
import contextlib
import dataclasses
import glob
import gzip
import hashlib
import http.server
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bench
import prepare_data
import model as M
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results'))
import report  # noqa: E402  (results/report.py: the tables of runs)
from model import (FORCES, INTEGRATORS, PRESETS, QK_TRANSFORMS, GPT, GPTConfig, Hamiltonian, Integrator, Invertible,
                   KVCache, attn_names, flops_per_token, qk_diagnostics)

ATTN = attn_names()
TRANSFORMS = [a for a in ATTN if a not in ('standard', 'diff')]  # variants with a q/k map


@pytest.fixture(autouse=True)
def seeded():  # every test starts from the same random state, whatever ran before it (a fork's tests, any order)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def tiny(attn='standard', **kw):
    cfg = dict(block_size=16, vocab_size=50, n_layer=2, n_head=4, n_embd=32, attn=attn)
    cfg.update(kw)
    return GPTConfig(**cfg)


def build(attn='standard', seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(tiny(attn, **kw), verbose=False)


def qk_maps(model):
    return [blk.attn.qk for blk in model.transformer.h]


def randomize_qk(model, scale=0.5, seed=1):
    """Move every q/k map off its initialization (zero-init last layers of invertible, etc.)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.qk_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def idx_batch(B=2, T=16, vocab=50, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# configuration

@pytest.mark.parametrize('kw, words', [
    (dict(attn='hamiltonian'), 'coupled'),
    (dict(attn='diffusion'), "attn='diffusion' is unknown"),  # [diff+]<entry>, split on '+': no prefix is stripped
    (dict(attn='diff+diff'), 'diff'),
    (dict(attn='standard+coupled'), r'diff\+coupled'),
    (dict(n_embd=30, n_head=4), 'divisible'),
    (dict(attn='diff', n_head=3, n_embd=36), 'even'),
    (dict(attn='diff+coupled', n_head=5, n_embd=40), 'even'),
    (dict(qk_steps=0), '1..7'),
    (dict(qk_steps=8), '1..7'),
    (dict(pos='alibi'), 'rope'),
    (dict(pos='rope', n_embd=36, n_head=4), 'even head size'),
    (dict(dropout=1.0), 'dropout'),
    (dict(qk_hidden=0), 'qk_hidden'),
])
def test_bad_config_says_what_is_allowed(kw, words):
    with pytest.raises(ValueError, match=words):
        tiny(**kw)


# ---------------------------------------------------------------------------------------------------------------
# every variant: shapes, loss, gradients, causality

@pytest.mark.parametrize('attn', ATTN)
def test_forward_shapes_and_finite_loss(attn):
    model = build(attn)
    idx = idx_batch()
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (2, 16, 50)
    assert torch.isfinite(loss) and abs(loss.item() - math.log(50)) < 1.0  # near chance at init
    logits2, loss2 = model(idx)
    assert loss2 is None and torch.equal(logits, logits2)


@pytest.mark.parametrize('attn', TRANSFORMS)
def test_gradients_reach_every_dynamics_parameter(attn):
    model = build(attn)
    if 'invertible' in attn:
        randomize_qk(model, 0.1)  # its last layers start at zero, which blocks the first layers' gradient at init
    idx = idx_batch()
    model(idx, targets=idx)[1].backward()
    qk = {id(p) for p in model.qk_parameters()}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in qk]
    assert named and all('.qk.' in n for n, _ in named)
    for n, p in named:
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {n}"
    for i, qk in enumerate(qk_maps(model)):  # the learned per-head scalars it declares (dt) are among them
        assert all(f'transformer.h.{i}.attn.qk.{s}' in dict(named) for s in getattr(qk, 'scalars', ()))


@pytest.mark.parametrize('attn', ATTN)
@pytest.mark.parametrize('pos', ['learned', 'rope'])
def test_causality(attn, pos):
    model = build(attn, pos=pos)
    randomize_qk(model)
    idx = idx_batch()
    t = 6
    changed = idx.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 7) % 50
    a, b = model(idx)[0], model(changed)[0]
    assert torch.allclose(a[:, :t + 1], b[:, :t + 1], atol=1e-6)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:], atol=1e-4)  # the change is visible afterwards


def base_and(attn, seed=1):  # base attention (standard or diff), and attn with the same weights wherever they agree
    ref, model = build('diff' if tiny(attn).diff else 'standard'), build(attn, seed=seed)
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all('.qk.' in n for n in missing)
    return ref, model


@pytest.mark.parametrize('attn', TRANSFORMS)
def test_dt_zero_is_exactly_the_base_attention(attn):
    name = tiny(attn).qk_name
    if not QK_TRANSFORMS[name].identity_at_zero:
        pytest.skip(f"{name} claims no identity at dt = 0")
    ref, model = base_and(attn)
    randomize_qk(model)  # arbitrary dynamics weights ...
    with torch.no_grad():
        for qk in qk_maps(model):  # ... but dt = 0
            assert hasattr(qk, 'dt'), f"{name} claims identity_at_zero but has no step size dt"
            qk.dt.zero_()
    idx = idx_batch()
    assert torch.equal(model(idx)[0], ref(idx)[0])
    # and the default initialization is not the identity (the test above can fail)
    assert not torch.allclose(build(attn, seed=1)(idx)[0], ref(idx)[0], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the Hamiltonian dynamics, on their own: tensors shaped (B, n_head, T, head_dim)

def hamiltonian(integrator, steps=1, hs=8, nh=3, seed=0, cls=Hamiltonian, force='potential'):
    torch.manual_seed(seed)
    h = cls(nh, hs, 6, steps, integrator, force=force).double()
    with torch.no_grad():
        h.dt.copy_(torch.tensor([0.3, -0.5, 0.8][:nh], dtype=torch.float64))
        h.f.a.mul_(3.0 if force == 'potential' else 3.0 * math.sqrt(hs))  # a strong force, so it matters
        h.f.b.normal_()
    return h


def qk_pair(B=2, nh=3, T=5, hs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64),
            torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64))


def new_name(stem):  # a name no table holds: a forker's entry of the same name cannot collide with a test's
    return next(f'{stem}-{i}' for i in itertools.count() if f'{stem}-{i}' not in {**INTEGRATORS, **QK_TRANSFORMS,
                                                                                    **FORCES})


def test_closed_form_force_equals_autograd_gradient_of_potential():
    h = hamiltonian('leapfrog')
    q, _ = qk_pair()
    q.requires_grad_(True)
    (grad,) = torch.autograd.grad(h.f.V(q).sum(), q)  # V(q), summed over tokens
    assert torch.allclose(h.force(q), -grad, atol=1e-12)
    assert grad.abs().max() > 1e-2
    scale = h.dt.view(-1, 1, 1)  # the integrators fold dt into the force's a: same as scaling after
    assert torch.allclose(h.force(q, scale), scale * h.force(q), atol=1e-12)


def test_the_free_force_is_the_reviews_two_layer_silu_mlp_per_head():
    h = hamiltonian('euler', force='mlp')
    q, _ = qk_pair()
    A, W, b = h.f.a, h.f.W, h.f.b  # A (nh, hs, m), W (nh, m, hs), b (nh, 1, m)
    assert A.shape == (3, 8, 6) and W.shape == (3, 6, 8) and type(h.f) is FORCES['mlp']
    want = torch.einsum('hij,bhtj->bhti', A, F.silu(torch.einsum('hjk,bhtk->bhtj', W, q) + b[None]))
    assert torch.allclose(h.force(q), want, atol=1e-12) and want.abs().max() > 0.1


def test_euler_mlp_is_the_reviews_equation_line_for_line():
    # q_{t+1} = q_t + dt k_t,  k_{t+1} = k_t + dt f(q_t), f(q) = A silu(W q + b), dt learned per head; n steps
    model = build('euler-mlp', qk_steps=3)
    randomize_qk(model, 0.3)
    qk = qk_maps(model)[0]
    q, k = (x.float() for x in qk_pair(nh=4))
    dt = qk.dt.view(1, -1, 1, 1)
    A, W, b = qk.f.a, qk.f.W, qk.f.b  # (nh, hs, m), (nh, m, hs), (nh, 1, m)
    f = lambda q: torch.einsum('hij,bhtj->bhti', A, F.silu(torch.einsum('hjk,bhtk->bhtj', W, q) + b[None]))
    q1, k1 = q, k
    for _ in range(3):
        q1, k1 = q1 + dt * k1, k1 + dt * f(q1)
    got = qk(q, k)
    assert torch.allclose(got[0], q1, atol=1e-5) and torch.allclose(got[1], k1, atol=1e-5)
    assert (k1 - k).abs().max() > 0.1


def test_leapfrog_under_bfloat16_autocast():
    model = build('coupled')
    idx = idx_batch()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        loss = model(idx, targets=idx)[1]
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - math.log(50)) < 1.0
    for qk in qk_maps(model):
        assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in qk.parameters())


@pytest.mark.parametrize('force', FORCES)
@pytest.mark.parametrize('steps', [1, 3, 7])
def test_leapfrog_is_reversible_with_either_force(steps, force):
    h = hamiltonian('leapfrog', steps, force=force)
    q, k = qk_pair()
    q1, k1 = h(q, k)
    assert (q1 - q).abs().max() > 0.1  # it moved
    q0, k0 = h(q1, k1, dt=-h.dt)  # back: the same map with -dt
    assert torch.allclose(q0, q, atol=1e-6, rtol=0) and torch.allclose(k0, k, atol=1e-6, rtol=0)


def test_euler_is_not_reversible_by_negating_dt():
    h = hamiltonian('euler')
    q, k = qk_pair()
    q0, k0 = h(*h(q, k), dt=-h.dt)
    assert not torch.allclose(q0, q, atol=1e-3)


def jacobian(h, hs, seed=3):
    """J = d(q', k')/d(q, k) for one token of one head (nh=1, B=1, T=1), in float64: (2 hs, 2 hs)."""
    def f(x):
        q1, k1 = h(x[:hs].view(1, 1, 1, hs), x[hs:].view(1, 1, 1, hs))
        return torch.cat((q1.flatten(), k1.flatten()))
    x = torch.randn(2 * hs, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.functional.jacobian(f, x)


def jacobian_det(h, hs):
    return torch.linalg.det(jacobian(h, hs)).item()


def symplectic_error(h, hs=4, seed=3):  # |J^T Omega J - Omega| for one token, Omega = [[0, I], [-I, 0]]
    omega = torch.zeros(2 * hs, 2 * hs, dtype=torch.float64)
    omega[:hs, hs:], omega[hs:, :hs] = torch.eye(hs), -torch.eye(hs)
    J = jacobian(h, hs, seed)
    return (J.T @ omega @ J - omega).abs().max().item()


@pytest.mark.parametrize('steps', [1, 4])
def test_leapfrog_preserves_volume_and_euler_does_not(steps):
    hs = 4
    leap, euler = hamiltonian('leapfrog', steps, hs=hs, nh=1), hamiltonian('euler', steps, hs=hs, nh=1)
    assert abs(jacobian_det(leap, hs) - 1.0) < 1e-10
    assert abs(jacobian_det(euler, hs) - 1.0) > 1e-3


@pytest.mark.parametrize('steps', [1, 4])
def test_leapfrog_is_symplectic_and_euler_is_not(steps):
    # the definition: J^T Omega J = Omega for the map's Jacobian J, Omega = [[0, I], [-I, 0]]
    for seed in (3, 4, 5):  # three tokens
        assert symplectic_error(hamiltonian('leapfrog', steps, hs=4, nh=1), seed=seed) < 1e-12
        assert symplectic_error(hamiltonian('euler', steps, hs=4, nh=1), seed=seed) > 1e-2


@pytest.mark.parametrize('steps', [1, 4])
def test_free_force_leapfrog_keeps_volume_and_returns_but_is_not_symplectic_until_f_is_a_gradient(steps):
    # the glossary's "volume preservation is much weaker" made visible: kicks and drifts are shears whatever f is, but
    # J^T Omega J = Omega needs a symmetric force Jacobian A diag(silu') W, i.e. f = grad of something
    hs = 4
    h = hamiltonian('leapfrog', steps, hs=hs, nh=1, force='mlp')
    q, k = qk_pair(nh=1, hs=hs)
    q0, k0 = h(*h(q, k), dt=-h.dt)
    assert (q0 - q).abs().max() < 1e-12 and (k0 - k).abs().max() < 1e-12
    for seed in (3, 4):
        assert abs(torch.linalg.det(jacobian(h, hs, seed)).item() - 1) < 1e-10
        assert symplectic_error(h, hs, seed) > 0.05
    # A = W^T diag(c): f(q) = W^T (c * silu(W q + b)) = grad sum_j c_j G(w_j . q + b_j), G' = silu: a gradient
    with torch.no_grad():
        h.f.a.copy_(h.f.W.transpose(1, 2) * torch.randn(1, 1, 6, dtype=torch.float64))
    assert max(symplectic_error(h, hs, seed) for seed in (3, 4)) < 1e-12
    assert (h(q, k)[1] - k).abs().max() > 0.1  # and it still moves


def energy(h, q, k):  # H(q, k) = 1/2 |k|^2 + V(q): (..., nh, N); only a gradient force has one
    return 0.5 * k.pow(2).sum(-1) + h.f.V(q)


def test_leapfrog_energy_drift_is_small_and_euler_drifts():
    # symplectic integrators keep H(q, k) = |k|^2/2 + V(q) nearly constant over many steps; Euler does not
    leap, euler = hamiltonian('leapfrog', 7), hamiltonian('euler', 7)
    with torch.no_grad():
        for h in (leap, euler):
            h.dt.fill_(0.05)
    q, k = qk_pair()
    e0 = energy(leap, q, k)
    drift = lambda h: (energy(h, *h(q, k)) - e0).abs().mean().item()
    assert drift(leap) < 0.1 * drift(euler)


class Pendulum(Hamiltonian):  # exercise 1's: V(q) = -cos(q), F(q) = -sin(q)
    def force(self, q, scale=1.0):
        return -scale * torch.sin(q)


def test_a_pendulums_energy_error_falls_with_each_integrators_order():
    # exercise 1's harness: the largest |H - H0| from rest at q = 1 to time 20, one call per step of dt
    def worst(integrator, dt):
        h = Pendulum(1, 1, 1, 1, integrator, dt=dt).double()
        q, k = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64)
        H = lambda q, k: 0.5 * k.item() ** 2 - math.cos(q.item())
        e0, err = H(q, k), 0.0
        with torch.no_grad():
            for _ in range(round(20 / dt)):
                q, k = h(q, k)
                err = max(err, abs(H(q, k) - e0))
        return err
    for name in ('leapfrog', 'euler'):
        order = INTEGRATORS[name].order
        assert 0.7 * 2 ** order < worst(name, 0.1) / worst(name, 0.05) < 1.4 * 2 ** order, name


# ---------------------------------------------------------------------------------------------------------------
# every entry keeps what it promises, with its own force: the claims of QK_TRANSFORMS (and of INTEGRATORS, for the
# potential's force) measured on one head of a map moved off its initialization. `pytest -k <name>` runs them

CLAIMS = ('symplectic', 'volume_preserving', 'symmetric', 'order', 'identity_at_zero')


def one_head(qk, seed=0, dt=0.4):
    """qk (one head) in float64, its parameters moved off their init so the force matters, every step size dt."""
    qk = qk.double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in qk.named_parameters():
            if n not in getattr(qk, 'scalars', ()):  # a forker's per-head scalar (a damping) keeps its value
                p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        if hasattr(qk, 'dt'):
            qk.dt.fill_(dt)
    return qk


def entry_map(name, steps=2, hs=4):  # QK_TRANSFORMS[name]'s map for one head, as the model builds it
    torch.manual_seed(0)
    return one_head(M.qk_transform(name, 1, hs, tiny(name, qk_steps=steps, qk_hidden=8, qk_scale=0)))


@contextlib.contextmanager
def step_size(qk, scale):  # qk's step size dt times scale (0: dt = 0, -1: a step back), for the block
    if not hasattr(qk, 'dt'):
        raise AssertionError(f"{type(qk).__name__} has no step size dt to scale")
    saved = qk.dt.detach().clone()
    with torch.no_grad():
        qk.dt.mul_(scale)
    try:
        yield
    finally:
        with torch.no_grad():
            qk.dt.copy_(saved)


def measure(make, claim, hs=4):
    """(holds, what was measured) for a claim about the map make(steps) builds."""
    q, k = qk_pair(B=1, nh=1, T=3, hs=hs, seed=7)
    if claim in ('symplectic', 'volume_preserving'):
        Js = [jacobian(make(2), hs, seed) for seed in (3, 4)]
        if claim == 'volume_preserving':
            err = max(abs(torch.linalg.det(J).item() - 1) for J in Js)
            return err < 1e-10, f"|det J - 1| = {err:.1e}"
        omega = torch.zeros(2 * hs, 2 * hs, dtype=torch.float64)
        omega[:hs, hs:], omega[hs:, :hs] = torch.eye(hs), -torch.eye(hs)
        err = max((J.T @ omega @ J - omega).abs().max().item() for J in Js)
        return err < 1e-10, f"|J^T Omega J - Omega| = {err:.1e}"
    qk = make(2)
    with torch.no_grad():
        if claim == 'symmetric':
            q1, k1 = qk(q, k)
            with step_size(qk, -1):
                q0, k0 = qk(q1, k1)
            err = max((q0 - q).abs().max().item(), (k0 - k).abs().max().item())
            return err < 1e-10, f"a step of -dt misses the start by {err:.1e}"
        if claim == 'identity_at_zero':
            with step_size(qk, 0):
                q1, k1 = qk(q, k)
            return torch.equal(q1, q) and torch.equal(k1, k), f"dt = 0 moves (q, k) by {(k1 - k).abs().max():.1e}"
        # order: the state's error at time 1 after n calls of dt = 1/n, against n = 1024's (no energy needed)
        qk, errors = make(1), {}
        for n in (1024, 16, 8):
            x = (q, k)
            with step_size(qk, 1 / (n * qk.dt[0].item())):
                for _ in range(n):
                    x = qk(*x)
            errors[n] = x if n == 1024 else max((a - b).abs().max().item() for a, b in zip(x, errors[1024]))
        ratio = errors[8] / errors[16]
        return ratio, f"the error falls {ratio:.1f}x as dt halves"


def claim_failure(name, claim, claimed, make):
    """What refutes a claim ('' if nothing): measured when it can be; a map without a step size dt can claim no
    symmetry, order or identity."""
    if claim in ('symmetric', 'order', 'identity_at_zero') and not hasattr(make(1), 'dt'):
        return f"{name} claims {claim}={claimed}, but has no step size dt to test it with" if claimed else ''
    if claim == 'order':
        if claimed is None:
            return ''
        ratio, what = measure(make, claim)
        return '' if 0.7 * 2 ** claimed < ratio < 1.4 * 2 ** claimed else f"{name} claims order={claimed}: {what}"
    holds, what = measure(make, claim)
    return '' if holds == claimed else f"{name} claims {claim}={claimed}: {what}"


@pytest.mark.parametrize('claim', CLAIMS)
@pytest.mark.parametrize('name', QK_TRANSFORMS)
def test_each_entry_keeps_what_it_promises(name, claim):
    # coupled-mlp: volume-preserving and symmetric but not symplectic (a free force); uncoupled: order 1 (Euler of
    # q' = g_q(q), k' = g_k(k)); invertible: no dt, so no such claims (its identity at init: its own test)
    failure = claim_failure(name, claim, getattr(QK_TRANSFORMS[name], claim), lambda steps: entry_map(name, steps))
    assert not failure, failure


@pytest.mark.parametrize('claim', CLAIMS[:-1])
@pytest.mark.parametrize('name', INTEGRATORS)
def test_each_integrator_keeps_what_it_promises_under_the_potential(name, claim):
    # symplectic-euler (kick, then drift) is symplectic like leapfrog but, unlike it, first order and not symmetric
    make = lambda steps: one_head(Hamiltonian(1, 4, 8, steps, name))
    failure = claim_failure(name, claim, getattr(INTEGRATORS[name], claim), make)
    assert not failure, failure


def test_a_false_claim_fails_naming_the_entry_and_the_claim(monkeypatch):
    name = new_name('overclaimed')
    monkeypatch.setitem(QK_TRANSFORMS, name, M.dynamics('leapfrog', 'mlp', symplectic=True, order=3))
    for claim, words in (('symplectic', 'claims symplectic=True: |J^T Omega J - Omega| = '),
                         ('order', 'claims order=3: the error falls ')):
        with pytest.raises(AssertionError, match=re.escape(f"{name} {words}")):
            test_each_entry_keeps_what_it_promises(name, claim)
    test_each_entry_keeps_what_it_promises(name, 'volume_preserving')  # its true claims hold


def test_n_leapfrog_steps_pay_2n_forces_and_equal_kick_drift_kick():
    calls = []

    class Counted(Hamiltonian):
        def force(self, q, scale=1.0):
            calls.append(1)
            return super().force(q, scale)
    h = hamiltonian('leapfrog', 3, cls=Counted)
    q, k = qk_pair()
    q1, k1 = h(q, k)
    assert len(calls) == 2 * 3  # each step computes both its forces: nothing is handed on, as the FLOP model says
    dt = h.dt.view(-1, 1, 1)
    q, k = (x.transpose(0, 1).reshape(3, -1, 8) for x in (q, k))
    for _ in range(3):  # kick-drift-kick: the same numbers, bit for bit
        k = k + h.force(q, dt / 2)
        q = q + dt * k
        k = k + h.force(q, dt / 2)
    q1, k1 = (x.transpose(0, 1).reshape(3, -1, 8) for x in (q1, k1))
    assert torch.equal(q1, q) and torch.equal(k1, k)


def test_an_unknown_integrator_or_force_is_an_error_at_construction():
    unknown = new_name('unknown')
    with pytest.raises(ValueError, match='leapfrog'):  # the message lists the names
        Hamiltonian(2, 4, 3, 1, unknown)
    with pytest.raises(ValueError, match=f"force '{unknown}' is unknown; choose one of potential, mlp"):
        Hamiltonian(2, 4, 3, 1, force=unknown)


def test_a_table_refuses_a_taken_name():
    # exercise 6 registered as 'euler' would silently replace the built-in: refused, naming it
    for table, name in ((INTEGRATORS, 'euler'), (QK_TRANSFORMS, 'coupled'), (FORCES, 'mlp')):
        before = table[name]
        with pytest.raises(ValueError, match=f"'{name}' is taken; give yours another name"):
            table[name] = before
        assert table[name] is before


class Damped(Hamiltonian):
    """A forker's change of the step: k <- (1 - gamma) k after each step, gamma learned per head, (nh, 1, 1)."""
    scalars = ('dt', 'gamma')

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gamma = torch.nn.Parameter(torch.full((self.dt.numel(), 1, 1), 0.2))

    def step(self, q, k, dt):
        q, k = super().step(q, k, dt)
        return q, (1 - self.gamma) * k


def test_an_overridden_step_is_taken_at_every_one_of_qk_steps():
    damped, one = hamiltonian('leapfrog', 3, cls=Damped), hamiltonian('leapfrog', 1)
    q, k = qk_pair()
    q1, k1 = damped(q, k)
    for _ in range(3):  # the intended map, written out: a step, then the damping, three times
        q, k = one(q, k)
        k = (1 - damped.gamma) * k  # (nh, 1, 1), 0.2
    assert torch.allclose(q1, q, atol=1e-12, rtol=0) and torch.allclose(k1, k, atol=1e-12, rtol=0)
    assert not torch.allclose(q1, hamiltonian('leapfrog', 3)(*qk_pair())[0], atol=1e-3)


def test_a_damped_entry_stating_no_identity_keeps_its_promises_and_its_scalar_is_reported_not_decayed(monkeypatch):
    name = new_name('damped')
    monkeypatch.setitem(QK_TRANSFORMS, name, M.dynamics('leapfrog', cls=Damped, symplectic=False, symmetric=False,
                                                        volume_preserving=False, order=None, identity_at_zero=False))
    for claim in CLAIMS:
        test_each_entry_keeps_what_it_promises(name, claim)
    model = build(name, qk_decay=True)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decayed = {id(p) for g in opt.param_groups if g['weight_decay'] > 0 for p in g['params']}
    for qk in qk_maps(model):  # (nh, 1, 1) is no matrix: its role is a per-head scalar
        assert id(qk.gamma) not in decayed and id(qk.dt) not in decayed and id(qk.f.W) in decayed
    stats = diagnose(model)
    assert all(s['gamma'] == pytest.approx([0.2] * 4) and len(s['dt']) == 4 for s in stats)


class QKNorm(nn.Module):
    """A forker's map with no dynamics: QK-norm, q, k <- g q / |q|, g k / |k|, a gain g learned per head. It reads no
    --qk_hidden, --qk_steps, --qk_dt or --qk_scale (its constructor names none), has no matrices and no matmul."""
    scalars = ('g',)

    def __init__(self, n_head, head_size):
        super().__init__()
        self.g = nn.Parameter(torch.full((n_head, 1, 1), math.sqrt(head_size)))  # (nh, 1, 1): |q'| = |k'| = sqrt(hs)

    def forward(self, q, k):  # (B, nh, T, hs) -> the same
        return self.g * q / q.norm(dim=-1, keepdim=True), self.g * k / k.norm(dim=-1, keepdim=True)


QK_NORM = M.QKTransform(QKNorm, lambda c: {}, width=lambda m: m, flops=lambda hs, m, n: (0, 4 * hs),  # /|.|, * g
                        symplectic=False, volume_preserving=False, symmetric=False, order=None, identity_at_zero=False)


def per_entry_tests(name):
    """Every call of a test parametrized by all entries (QK_TRANSFORMS, TRANSFORMS or ATTN), with name where coupled
    and diff+coupled stand: (its id, a call), so that a new per-entry test counts without being listed here."""
    entries = {'coupled': name, 'diff+coupled': 'diff+' + name}
    for test_name, test in list(globals().items()):
        marks = [m for m in getattr(test, 'pytestmark', []) if m.name == 'parametrize']
        if not test_name.startswith('test_') or not any(list(m.args[1]) in (list(QK_TRANSFORMS), TRANSFORMS,
                                                                            list(ATTN)) for m in marks):
            continue
        axes = []
        for m in marks:
            values = list(m.args[1])
            if values in (list(QK_TRANSFORMS), TRANSFORMS, list(ATTN)):
                values = [entries[v] for v in values if v in entries]
            axes.append([dict(zip([a.strip() for a in m.args[0].split(',')], v if ',' in m.args[0] else (v,)))
                         for v in values])
        for combo in itertools.product(*axes):
            kw = {k: v for d in combo for k, v in d.items()}
            yield f"{test_name}[{kw}]", lambda test=test, kw=kw: test(**kw)


def test_an_honest_map_with_no_dynamics_passes_every_per_entry_test(monkeypatch):
    # QK-norm: no dt (no symmetry, order or identity to claim), no matrices, no matmul, no width it reads
    name = new_name('qk-norm')
    monkeypatch.setitem(QK_TRANSFORMS, name, QK_NORM)
    ran, skipped = [], []
    for what, call in per_entry_tests(name):
        try:
            call()
            ran.append(what)
        except pytest.skip.Exception:
            skipped.append(what)
    assert len(ran) > 25 and all('dt_zero' in what for what in skipped), (len(ran), skipped)  # no identity claimed
    model = build(name, qk_decay=True)
    assert all(torch.equal(qk.g, torch.full((4, 1, 1), math.sqrt(8))) for qk in qk_maps(model))


def test_a_q_k_maps_own_initialization_is_left_alone_by_the_models(monkeypatch):
    # an nn.Linear inside a q/k map, zero-initialized on purpose, stays zero; GPT's init still reaches c_attn
    class Mixed(QKNorm):
        def __init__(self, n_head, head_size):
            super().__init__(n_head, head_size)
            self.mix = nn.Linear(head_size, head_size)
            nn.init.zeros_(self.mix.weight)

        def forward(self, q, k):
            return super().forward(q + self.mix(q), k)
    name = new_name('mixed')
    monkeypatch.setitem(QK_TRANSFORMS, name, QK_NORM._replace(cls=Mixed))
    model = build(name)
    assert all(not qk.mix.weight.any() for qk in qk_maps(model))
    assert 0.015 < model.transformer.h[0].attn.c_attn.weight.std() < 0.025


def invert(inv, q, k):  # Invertible's map backwards: q = (q - t2(k)) exp(-s2(k)), then k = (k - t1(q)) exp(-s1(q))
    for _ in range(inv.steps):
        s2, t2 = inv.scale_shift(inv.st2, k)
        q = (q - t2) * torch.exp(-s2)
        s1, t1 = inv.scale_shift(inv.st1, q)
        k = (k - t1) * torch.exp(-s1)
    return q, k


@pytest.mark.parametrize('steps', [1, 2])
def test_invertible_coupling_inverts_exactly(steps):
    torch.manual_seed(0)
    inv = Invertible(3, 8, 4, steps).double()
    q, k = qk_pair()
    assert torch.equal(inv(q, k)[0], q)  # identity at initialization
    with torch.no_grad():
        for p in inv.parameters():
            p.add_(0.5 * torch.randn_like(p))
    q1, k1 = inv(q, k)
    assert (k1 - k).abs().max() > 0.1
    q0, k0 = invert(inv, q1, k1)
    assert torch.allclose(q0, q, atol=1e-10) and torch.allclose(k0, k, atol=1e-10)


@pytest.mark.parametrize('attn', ['invertible', 'diff+invertible'])
def test_invertible_at_init_is_exactly_the_base_attention(attn):
    ref, model = base_and(attn)
    idx = idx_batch()
    assert torch.equal(model(idx)[0], ref(idx)[0])
    randomize_qk(model)
    assert not torch.allclose(model(idx)[0], ref(idx)[0], atol=1e-6)


@pytest.mark.parametrize('attn', QK_TRANSFORMS)
def test_qk_map_acts_per_token_and_is_callable_alone(attn):
    # the map of position t depends on position t only: shuffling positions commutes with it
    model = build(attn)
    randomize_qk(model)
    qk = qk_maps(model)[0].double()  # float64: a strong map's float32 rounding is no part of the question
    q, k = qk_pair(nh=4, T=6, hs=8)
    perm = torch.randperm(6)
    q1, k1 = qk(q, k)
    q2, k2 = qk(q[:, :, perm], k[:, :, perm])
    assert q1.shape == q.shape and torch.allclose(q1[:, :, perm], q2, atol=1e-10)
    assert torch.allclose(k1[:, :, perm], k2, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------------
# differential attention

def test_diff_lambda_init_schedule():
    model = build('diff', n_layer=4)
    got = [blk.attn.lambda_init for blk in model.transformer.h]
    want = [0.8 - 0.6 * math.exp(-0.3 * layer) for layer in range(4)]
    assert got == pytest.approx(want) and got[0] == pytest.approx(0.2)


def test_diff_parameter_count_within_one_percent_of_standard():
    with torch.device('meta'):
        n_std = GPT(GPTConfig(**PRESETS['tiny'], vocab_size=257), verbose=False).get_num_params()
        n_diff = GPT(GPTConfig(attn='diff', **PRESETS['tiny'], vocab_size=257), verbose=False).get_num_params()
    assert n_diff != n_std and abs(n_diff - n_std) / n_std < 0.01


# ---------------------------------------------------------------------------------------------------------------
# KV cache and generation

@pytest.mark.parametrize('attn', ATTN)
@pytest.mark.parametrize('pos', ['learned', 'rope'])
def test_kv_cache_logits_equal_full_forward(attn, pos):
    model = build(attn, pos=pos).eval()
    randomize_qk(model)
    idx = idx_batch(T=12)
    full = model(idx)[0]
    cache = KVCache(model.config.n_layer)
    steps = [model(idx[:, :5], cache=cache)[0]]  # a prompt, then one token at a time
    steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 12)]
    assert len(cache) == 12
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    # a chunk of several new tokens on top of a cache is masked causally too
    cache = KVCache(model.config.n_layer)
    parts = [model(idx[:, :4], cache=cache)[0], model(idx[:, 4:12], cache=cache)[0]]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


@pytest.mark.parametrize('attn', ['standard', 'coupled', 'diff+invertible'])
def test_generate_with_cache_equals_recomputing(attn):
    model = build(attn).eval()
    randomize_qk(model)
    prompt = idx_batch(T=3)
    # 20 new tokens run past block_size=16: the cache must refill its window exactly like recomputation
    a = model.generate(prompt, 20, temperature=0, use_cache=True)
    b = model.generate(prompt, 20, temperature=0, use_cache=False)
    assert a.shape == (2, 23) and torch.equal(a, b)
    torch.manual_seed(5)
    s = model.generate(prompt, 8, temperature=0.8, top_k=5)
    assert s.shape == (2, 11) and torch.equal(s[:, :3], prompt)


def test_forward_past_block_size_is_refused():
    with pytest.raises(ValueError, match='block_size'):
        build()(idx_batch(T=17, seed=0))


# ---------------------------------------------------------------------------------------------------------------
# parameter overhead at the paper's 60M scale, and learning

def count_60m(attn):
    with torch.device('meta'):  # shapes only, no memory
        m = GPT(GPTConfig(attn=attn, **PRESETS['60m']), verbose=False)
    return m.get_num_params(), sum(p.numel() for p in m.qk_parameters())


@pytest.mark.parametrize('attn', ['coupled', 'euler-mlp', 'coupled-mlp'])
def test_coupling_adds_the_papers_budget_at_60m(attn):
    n_std, _ = count_60m('standard')
    n, n_qk = count_60m(attn)
    assert n - n_std == n_qk and 55e6 < n_std < 70e6
    assert 0.0010 <= n_qk / n_std <= 0.0012  # the paper: 0.11%


def test_the_free_force_is_6_wide_at_60m_and_v2_adds_about_0_3_percent():
    n_std, _ = count_60m('standard')
    assert count_60m('euler-mlp')[1] == 12 * 8 * (2 * 6 * 64 + 6 + 1)  # layers x heads x (W, A, b; dt): 74,400
    assert 0.0025 <= count_60m('invertible')[1] / n_std <= 0.0035  # v2: about 0.3%


@pytest.mark.parametrize('attn', ['uncoupled', 'euler'])
def test_baselines_match_coupled_capacity_at_60m(attn):
    _, coupled = count_60m('coupled')
    _, other = count_60m(attn)
    assert abs(other - coupled) / coupled <= 0.03


def adamw_losses(model, steps=8):
    """The loss before each of `steps` AdamW steps on one batch, and after the last."""
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), 'cpu')
    idx, losses = idx_batch(B=4), []
    for _ in range(steps):
        loss = model(idx[:, :-1], targets=idx[:, 1:])[1]
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses + [model(idx[:, :-1], targets=idx[:, 1:])[1].item()]


@pytest.mark.parametrize('attn', ATTN)
def test_a_few_adamw_steps_lower_the_loss(attn):
    losses = adamw_losses(build(attn))
    assert losses[-1] < losses[0] - 0.2


@pytest.mark.parametrize('qk_decay', [False, True])
def test_weight_decay_falls_on_matrices_and_on_the_dynamics_only_when_asked(qk_decay):
    model = build('diff+coupled', qk_decay=qk_decay)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decayed = {id(p) for g in opt.param_groups if g['weight_decay'] > 0 for p in g['params']}
    assert len(decayed) + len({id(p) for g in opt.param_groups if g['weight_decay'] == 0 for p in g['params']}) \
        == len(list(model.parameters()))
    for n, p in model.named_parameters():
        if '.qk.' in n:  # W and a of the potential with qk_decay; never its b or the step sizes dt
            assert (id(p) in decayed) == (qk_decay and n.endswith(('.f.W', '.f.a'))), n
        else:  # Linear and Embedding matrices; not LayerNorm/RMSNorm gains, diff's lambda vectors
            assert (id(p) in decayed) == (p.dim() >= 2), n


def test_an_nn_linear_inside_a_q_k_module_is_decayed_with_qk_decay_and_its_bias_never():
    # decay by role, not by name: a forker's layer in the q/k map is a matrix like W
    for qk_decay in (False, True):
        model = build('coupled', qk_decay=qk_decay)
        for qk in qk_maps(model):
            qk.mix = torch.nn.Linear(8, 8)
        opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
        decayed = {id(p) for g in opt.param_groups if g['weight_decay'] > 0 for p in g['params']}
        for qk in qk_maps(model):
            assert (id(qk.mix.weight) in decayed) == (id(qk.f.W) in decayed) == qk_decay
            assert id(qk.mix.bias) not in decayed and id(qk.f.b) not in decayed and id(qk.dt) not in decayed


@pytest.mark.parametrize('attn', TRANSFORMS)
def test_qk_decay_falls_on_the_declared_matrices_only(attn):
    model = build(attn, qk_decay=True)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decayed = {id(p) for g in opt.param_groups if g['weight_decay'] > 0 for p in g['params']}
    for qk in qk_maps(model):  # its matrices by role: what its modules name in `matrices`, its nn.Linear weights
        declared = {id(getattr(m, n)) for m in qk.modules() for n in getattr(m, 'matrices', ())}
        declared |= {id(m.weight) for m in qk.modules() if isinstance(m, nn.Linear)}
        wrong = {n for n, p in qk.named_parameters() if (id(p) in decayed) != (id(p) in declared)}
        assert not wrong, f"{attn} declares {len(declared)} matrices; --qk_decay gets wrong: {sorted(wrong)}"
        assert all(id(getattr(qk, s)) not in decayed for s in getattr(qk, 'scalars', ())), f"{attn}: a scalar decays"


# ---------------------------------------------------------------------------------------------------------------
# the coupling diagnostic: how much of the q/k map is beyond what W_q, W_k could absorb

def diagnose(model):  # 256 tokens: above the nonlinear fit's floor at hs = 8 (8 x 17 unknowns)
    return qk_diagnostics(model, idx_batch(B=16, T=16))


def test_diagnostic_is_zero_when_dt_is_zero():
    model = build('coupled', qk_scale=2.0)
    with torch.no_grad():
        for qk in qk_maps(model):
            qk.dt.zero_()
    for s in diagnose(model):
        assert s['dq'] == 0 and s['dk'] == 0 and s['nonlinear'] < 1e-12


def test_diagnostic_sees_a_linear_potential_as_linear_and_a_curved_one_as_nonlinear():
    straight = build('coupled', qk_scale=0)  # SiLU's straight range: pre-activations of spread ~0.01
    with torch.no_grad():
        for qk in qk_maps(straight):
            qk.f.W.mul_(0.1)
            qk.f.a.mul_(30.0)  # a strong force, so the map moves things (dk clearly > 0), but linearly
    for s in diagnose(straight):
        assert s['dk'] > 0.05 and s['nonlinear'] < 2e-3
    curved = build('coupled', qk_scale=3.0, qk_dt=0.5)  # pre-activations of spread 3: SiLU's bend
    stats = diagnose(curved)
    assert all(s['nonlinear'] > 1e-2 for s in stats)
    assert len(stats) == 2 and len(stats[0]['nonlinear_heads']) == 4


@pytest.mark.parametrize('attn', TRANSFORMS)
def test_diagnostic_covers_every_q_k_transform(attn):
    model = build(attn)
    randomize_qk(model)
    stats = diagnose(model)
    heads = 4
    assert len(stats) == 2 and all(len(s['nonlinear_heads']) == heads and s['nonlinear'] > 0 for s in stats)
    for s, qk in zip(stats, qk_maps(model)):  # every learned per-head scalar it declares, by name
        assert all(s[name] == getattr(qk, name).flatten().tolist() for name in getattr(qk, 'scalars', ()))


@pytest.mark.parametrize('n_head', [8, 4])  # 256 wide: hs = 32 (the tiny preset's heads), hs = 64 (60m's)
def test_nonlinear_fraction_has_a_floor_and_reads_near_its_8192_token_value_above_it(n_head):
    # the affine fit has 2 hs + 1 unknowns per output: on about as many tokens it fits anything (it read 0.00%).
    # From FIT_TOKENS distinct tokens per unknown it is within 8% of its value on 8,192 tokens (a least-squares
    # residual shrinks as sqrt(1 - unknowns / tokens): 0.935 at the floor); below the floor, None
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=n_head, n_embd=256, vocab_size=257, block_size=64, attn='coupled'),
                verbose=False)
    idx = idx_batch(B=128, T=64, vocab=257)  # 8,192 tokens
    nonlinear = lambda x: qk_diagnostics(model, x)[0]['nonlinear']
    unknowns = 2 * 256 // n_head + 1
    at_floor = -(-M.FIT_TOKENS * unknowns // 64)  # sequences of 64 at the floor, and one fewer
    want = nonlinear(idx)
    assert want > 0.01 and nonlinear(idx[:at_floor]) == pytest.approx(want, rel=0.08)
    assert nonlinear(idx[:4 * at_floor]) == pytest.approx(want, rel=0.02)
    assert nonlinear(idx[:at_floor - 1]) is None and nonlinear(idx[:unknowns // 64 + 1]) is None
    assert nonlinear(idx[:1].repeat(128, 1)) is None  # 8,192 tokens, 64 distinct: too few tokens all the same
    stats = qk_diagnostics(model, idx[:2])[0]
    assert stats['nonlinear_heads'] is None and stats['dq'] > 0  # dq, dk need no fit
    both = [stats, qk_diagnostics(model, idx)[0]]  # a layer without a value is left out of the median (rope's
    assert M.median_layer(both, 'nonlinear') == both[1]['nonlinear']  # layer 0 never has enough distinct q, k)
    assert M.median_layer([stats], 'nonlinear') is None


def test_with_rotary_positions_the_first_layer_has_too_few_distinct_q_k_and_the_others_still_read():
    # rope adds no position to the embedding: layer 0's q, k are a function of the token (257 bytes at most), under
    # the fit's floor at any batch; the layers after it mix positions in, and the median reads them
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=257, block_size=64, attn='coupled', pos='rope'),
                verbose=False)
    stats = qk_diagnostics(model, idx_batch(B=128, T=64, vocab=257))
    assert stats[0]['nonlinear'] is None and stats[1]['nonlinear'] > 0
    assert M.median_layer(stats, 'nonlinear') == stats[1]['nonlinear']


@pytest.mark.parametrize('attn', ['coupled', 'euler-mlp'])
def test_qk_scale_sets_the_spread_of_the_forces_pre_activations(attn):
    cfg = tiny(attn, qk_scale=2.0)
    model = GPT(cfg, verbose=False)
    q = 0.02 * math.sqrt(cfg.n_embd) * torch.randn(1, 4, 4096, 8)  # q's spread at initialization
    z = model.transformer.h[0].attn.qk.f.pre(q)
    assert 1.8 < z.std().item() < 2.2


# ---------------------------------------------------------------------------------------------------------------
# the attention diagnostics: how uniform attention is, how much sits on the first position, how near rank one

def causal(rows):  # a (T, T) attention matrix from its rows' weights over positions 0..i
    T = len(rows)
    return torch.tensor([list(r) + [0.0] * (T - len(r)) for r in rows], dtype=torch.float64)


def test_attention_stats_of_hand_made_matrices():
    T = 6
    uniform = causal([[1 / (i + 1)] * (i + 1) for i in range(T)])
    first = causal([[1.0] + [0.0] * i for i in range(T)])  # every row on position 0: rank one
    s = 0.7                                                  # a sink: 0.7 on position 0, the rest spread evenly
    sunk = causal([[1.0]] + [[s] + [(1 - s) / i] * i for i in range(1, T)])
    u, f, i, k = (M.attention_stats(a) for a in (uniform, first, torch.eye(T, dtype=torch.float64), sunk))
    assert u['entropy'] == pytest.approx(1) and u['sink'] == pytest.approx(sum(1 / (i + 1) for i in range(1, T)) / 5)
    assert f['entropy'] == 0 and f['sink'] == 1 and f['gap'] == pytest.approx(0, abs=1e-12)
    assert i['entropy'] == 0 and i['sink'] == 0 and i['gap'] == pytest.approx(1)
    h = [(-s * math.log(s) - (1 - s) * math.log((1 - s) / n)) / math.log(n + 1) for n in range(1, T)]
    assert k['sink'] == pytest.approx(s) and k['entropy'] == pytest.approx(sum(h) / 5)
    assert 0 < k['gap'] < u['gap'] < 1  # a sink pulls every row toward one: nearer rank one than uniform rows
    heads = M.attention_stats(torch.stack((uniform, first))[None])  # (B, nh, T, T): the mean over heads
    assert heads == pytest.approx({key: (u[key] + f[key]) / 2 for key in u})
    assert M.attention_diagnostics(build(), idx_batch(T=1)) == []  # no row i >= 1


def sharpen(model, factor=30.0):  # larger q, k: peaked attention, far from the uniform rows of initialization
    with torch.no_grad():
        for blk in model.transformer.h:
            blk.attn.c_attn.weight.mul_(factor)


@pytest.mark.parametrize('attn, pos', [('standard', 'learned'), ('coupled', 'rope')])
def test_attention_diagnostics_read_the_probabilities_attention_applies(attn, pos):
    # the q, k at the hook point `scored` (after the q/k map and rotary) give the P with which attention mixes v
    model = build(attn, pos=pos)
    randomize_qk(model)
    sharpen(model)
    layer = model.transformer.h[1].attn
    seen = M.seen_by(model, idx_batch(), [layer.c_attn, layer.scored, layer.c_proj])  # (module, inputs, output)
    (_, _, qkv), (_, _, (q, k)), (_, (y,), _) = seen
    B, T, C = y.shape
    v = qkv.split(C, dim=2)[2].view(B, T, 4, C // 4).transpose(1, 2).double()  # (B, nh, T, hs)
    P = M.attention_probs(q, k, torch.float64)
    assert torch.allclose((P @ v).transpose(1, 2).reshape(B, T, C), y.double(), atol=1e-5)
    stats = M.attention_diagnostics(model, idx_batch())
    assert len(stats) == 2 and stats[1] == pytest.approx(M.attention_stats(M.attention_probs(q, k)))
    assert all(0 <= s[key] <= 1 for s in stats for key in s) and stats[1]['entropy'] < 0.8  # peaked: a real check


def test_diff_attention_is_measured_per_sub_softmax():
    # diff's n_head sub-heads are standard attention's n_head heads, each its own softmax: with the same weights,
    # layer 0 (same input, same q, k) measures the same; its signed rows (P1 - lambda P2) would not
    diff = build('diff')
    sharpen(diff)
    standard = build('standard')
    standard.load_state_dict(diff.state_dict(), strict=False)  # embeddings, c_attn, ...: all they share
    d, s = (M.attention_diagnostics(m, idx_batch()) for m in (diff, standard))
    assert len(d) == 2 and d[0] == pytest.approx(s[0], rel=1e-9) and s[0]['entropy'] < 0.8
    assert all(0 <= x[key] <= 1 for x in d for key in x)



def test_top_singular_values_match_the_full_decomposition():
    # sigma_1, sigma_2 by subspace iteration against svdvals, on attention near uniform (init) and peaked: the gap
    # (sigma_2 / sigma_1) within 1e-3 of the exact one, far below the spread between batches of sequences
    for factor in (1.0, 30.0):
        model = build('coupled', block_size=128)
        sharpen(model, factor)
        for _, _, (q, k) in M.seen_by(model, idx_batch(B=4, T=128), [b.attn.scored for b in model.transformer.h]):
            att = M.attention_probs(q, k, torch.float64)
            exact, fast = torch.linalg.svdvals(att)[..., :2], M.top_singular_values(att.float())
            assert fast.dtype == torch.float32 and fast.shape == (4, 4, 2)
            assert (fast[..., 1] / fast[..., 0] - exact[..., 1] / exact[..., 0]).abs().mean() < 1e-3, factor
            assert torch.allclose(fast[..., 0].double(), exact[..., 0], rtol=1e-4)


def test_attention_diagnostics_at_the_recipes_shape_read_eight_sequences_and_decompose_no_t_by_t_matrix():
    # 60m's heads (8 of 64) at block 512 on the recipe's eval batch (32 sequences; 2 layers, a small vocabulary:
    # the same per-layer work): the model sees 8 sequences, the largest tensor is one layer's (8, 8, 512, 512)
    # float32 probabilities (the old diagnostics: (32, 8, 512, 512) float64, 256 decompositions of 512 x 512 a layer),
    # and every singular value decomposition is of a (512, 8) block: 8 x 8 per layer
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.svd, self.largest, self.batches, self.wide = [], 0, set(), set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if 'svd' in name:
                self.svd.append(tuple(args[0].shape))
            if name == 'embedding' and args[1].dim() == 2:  # the tokens' (B, T), not the positions' (T,)
                self.batches.add(args[1].size(0))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                    self.largest, self.largest_dtype = t.numel(), t.dtype
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    self.wide.add(tuple(t.shape))
            return out

    torch.manual_seed(0)
    cfg = GPTConfig(**(PRESETS['60m'] | dict(n_layer=2)), vocab_size=64, block_size=512, attn='coupled')
    model = GPT(cfg, verbose=False)
    seen = Seen()
    with seen:
        stats = M.attention_diagnostics(model, idx_batch(B=32, T=512, vocab=64))
    assert len(stats) == 2 and seen.batches == {8}
    assert seen.largest == 8 * 8 * 512 * 512 and seen.largest_dtype == torch.float32 and not seen.wide
    assert len(seen.svd) == 2 and all(shape == (8, 8, 512, 8) for shape in seen.svd), seen.svd


# ---------------------------------------------------------------------------------------------------------------
# what trains is what you read: one code path for the dynamics, and a variant is one entry of QK_TRANSFORMS

def test_an_overridden_force_reaches_training():
    # a forker's first edit: a different force. Doubling F is doubling the potential's a, so the two models must
    # agree in loss and gradients (a's gradient doubles), and differ from the unmodified model
    class Doubled(Hamiltonian):
        def force(self, q, scale=1.0):
            return 2 * super().force(q, scale)
    plain, doubled, scaled = build('coupled'), build('coupled'), build('coupled')
    for m in (plain, doubled, scaled):
        randomize_qk(m)  # the same strong potential in all three, so the force matters
    for blk in doubled.transformer.h:
        blk.attn.qk.__class__ = Doubled
    with torch.no_grad():
        for qk in qk_maps(scaled):
            qk.f.a.mul_(2.0)
    idx = idx_batch()
    losses = []
    for m in (plain, doubled, scaled):
        loss = m(idx, targets=idx)[1]
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[2], abs=1e-6) and abs(losses[1] - losses[0]) > 1e-4
    for (n, p), q in zip(doubled.named_parameters(), scaled.parameters()):
        want = 2 * q.grad if n.endswith('.f.a') else q.grad
        assert torch.allclose(p.grad, want, atol=1e-6), n
    # and one optimizer step later the overridden model is still the doubled-a one
    for m in (doubled, scaled):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.step()
        m.zero_grad()
    assert doubled(idx, targets=idx)[1].item() != pytest.approx(losses[1], abs=1e-6)


@pytest.mark.parametrize('name', QK_TRANSFORMS)
def test_every_table_entry_builds_its_declared_class_integrator_force_width_and_cost(name):
    spec, cfg = QK_TRANSFORMS[name], PRESETS['60m']
    for attn in (name, 'diff+' + name):
        model = build(attn, qk_hidden=8, qk_dt=0.25)
        args = spec.args(model.config)
        for qk in qk_maps(model):
            assert type(qk) is spec.cls and getattr(qk, 'integrator', None) == args.get('integrator'), attn
            assert 'force' not in args or type(qk.f) is FORCES[args['force']], attn
            assert not hasattr(qk, 'dt') or torch.equal(qk.dt, torch.full((4,), 0.25)), attn  # --qk_dt reaches it
            widths = {mlp.W.shape[1] for mlp in qk.modules() if isinstance(mlp, M.HeadMLP)}
            assert widths <= {spec.width(8)}, f"{attn} declares width {spec.width(8)} at m = 8; its nets: {widths}"
    if spec.flops is not None:  # a map with no matmul prices 0 of them, but nothing costs nothing
        assert min(spec.flops(64, spec.width(12), 1)) >= 0 < sum(spec.flops(64, spec.width(12), 1)), \
            f"{name} prices {spec.flops(64, spec.width(12), 1)} (matmul, elementwise) FLOPs a token and head"
        assert flops_per_token(GPTConfig(attn=name, **cfg), 512) > flops_per_token(GPTConfig(**cfg), 512)


def test_a_transform_added_to_the_table_alone_trains_is_costed_and_keeps_its_integrator(monkeypatch):
    # a forker's new variant: another leapfrog potential, twice as wide; nothing but the table entry
    wide = new_name('wide')
    monkeypatch.setitem(QK_TRANSFORMS, wide, M.dynamics('leapfrog', width=lambda m: 2 * m))
    assert wide in attn_names() and 'diff+' + wide in attn_names()
    for attn in (wide, 'diff+' + wide):
        m = build(attn)
        assert all(qk.integrator == 'leapfrog' and qk.f.W.shape[1] == 24 for qk in qk_maps(m))
        assert sum(p.numel() for p in m.qk_parameters()) == sum(p.numel() for p in build(attn.replace(
            wide, 'coupled')).qk_parameters()) + 2 * 4 * (12 * 8 + 2 * 12)  # 2 layers x 4 heads x 12 more
        losses = adamw_losses(m)
        assert losses[-2] < losses[0] - 0.2
    cfg = GPTConfig(attn=wide, **PRESETS['60m'])
    assert flops_per_token(cfg, 512) > flops_per_token(GPTConfig(attn='coupled', **PRESETS['60m']), 512)
    r = run('-c', "import model, bench; from model import *; "
            f"model.QK_TRANSFORMS[{wide!r}] = dynamics('leapfrog', width=lambda m: 2 * m); "
            f"print(bench.flop_ratio(GPTConfig(attn={wide!r}, **PRESETS['60m']), 512))")
    assert r.returncode == 0 and 1.0 < float(r.stdout) < 1.05, r.stderr  # bench's FLOP model tabulates it


def test_an_entry_whose_name_starts_with_diff_is_not_differential_attention(monkeypatch):
    name = new_name('diffusion')
    monkeypatch.setitem(QK_TRANSFORMS, name, QK_TRANSFORMS['coupled'])
    cfg = tiny(name, n_head=3, n_embd=24)  # odd n_head: no sub-head pairs needed
    assert not cfg.diff and cfg.qk_name == name and tiny('diff+' + name).diff
    assert not build(name, n_head=3, n_embd=24).transformer.h[0].attn.diff


def test_an_entry_without_a_price_is_refused_where_a_price_is_needed_and_trains_without(monkeypatch):
    name = new_name('unpriced')
    monkeypatch.setitem(QK_TRANSFORMS, name, QK_TRANSFORMS['coupled']._replace(flops=None))
    with pytest.raises(ValueError, match=f"^{name} has no FLOP price \\(flops=None in its QK_TRANSFORMS entry\\)"):
        flops_per_token(GPTConfig(attn=name), 128)
    losses = adamw_losses(build(name))  # the model itself needs no price (train.py asks for one only for MFU)
    assert losses[-1] < losses[0]
    r = run('-c', f"import model, runpy, sys; model.QK_TRANSFORMS[{name!r}] = model.QK_TRANSFORMS['coupled']._replace("
            f"flops=None); sys.argv = ['bench.py', '--attn={name}', '--mode=train']; runpy.run_path('bench.py', "
            "run_name='__main__')")
    assert r.returncode == 1 and f'ValueError: {name} has no FLOP price' in r.stderr, r.stderr  # before any timing
    assert 'bench: preset' not in r.stdout



def counted_and_priced_matmul_flops(name, steps, B=2, T=3, nh=2, hs=8, m=12):
    """The matmul FLOPs of one forward of name's q/k map, as torch counts them and as its table entry prices them."""
    from torch.utils.flop_counter import FlopCounterMode
    spec = QK_TRANSFORMS[name]
    qk = M.qk_transform(name, nh, hs, tiny(name, qk_steps=steps, qk_hidden=m))
    with FlopCounterMode(display=False) as counter:
        qk(*torch.randn(2, B, nh, T, hs))
    return counter.get_total_flops(), B * T * nh * spec.flops(hs, spec.width(m), steps)[0]


@pytest.mark.parametrize('name', QK_TRANSFORMS)
@pytest.mark.parametrize('steps', [1, 3])
def test_every_entrys_price_is_what_torch_counts(name, steps):
    if QK_TRANSFORMS[name].flops is None:
        pytest.skip(f"{name} states no FLOP price")
    counted, priced = counted_and_priced_matmul_flops(name, steps)
    assert counted == priced, f"{name} prices {priced} matmul FLOPs, torch counts {counted}"


class Elementwise(torch.utils._python_dispatch.TorchDispatchMode):
    """The convention of the elementwise prices: one FLOP per output number of each pointwise aten op (torch's
    `pointwise` tag: add, mul, sigmoid, silu, exp, tanh, ...), copies (clone, copy_) not counted; torch's
    FlopCounterMode counts matmuls only. A sigmoid is one FLOP here, as an add is."""
    COPIES = ('aten.clone.default', 'aten.copy_.default', 'aten._to_copy.default')

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.pointwise in func.tags and str(func) not in self.COPIES:
            self.flops += out.numel()
        return out


@pytest.mark.parametrize('name', QK_TRANSFORMS)
@pytest.mark.parametrize('steps', [1, 3])
def test_every_entrys_elementwise_price_is_what_is_counted(name, steps, nh=2, hs=8, m=12):
    spec = QK_TRANSFORMS[name]
    if spec.flops is None:
        pytest.skip(f"{name} states no FLOP price")
    qk = M.qk_transform(name, nh, hs, tiny(name, qk_steps=steps, qk_hidden=m))

    def count(T):
        with Elementwise() as c:
            qk(*torch.randn(2, 2, nh, T, hs))
        return c.flops
    counted = (count(7) - count(3)) / (2 * 4 * nh)  # per token and head: what the parameters' own ops cost drops out
    priced = spec.flops(hs, spec.width(m), steps)[1]
    assert 0.8 * counted <= priced <= 1.25 * counted, f"{name} prices {priced} elementwise FLOPs, counted {counted}"


def test_a_wrong_elementwise_price_fails_naming_the_entry(monkeypatch):
    # exercise 6 priced at n * 1000000 or 0 elementwise FLOPs: caught by `-k <name>`
    coupled = QK_TRANSFORMS['coupled']
    for wrong in (lambda n: n * 1000000, lambda n: 0):
        name = new_name('mispriced')
        price = lambda hs, m, n, wrong=wrong: (coupled.flops(hs, m, n)[0], wrong(n))
        monkeypatch.setitem(QK_TRANSFORMS, name, coupled._replace(flops=price))
        with pytest.raises(AssertionError, match=f"{name} prices {wrong(1)} elementwise FLOPs, counted 200"):
            test_every_entrys_elementwise_price_is_what_is_counted(name, 1)


W1 = 1 / (2 - 2 ** (1 / 3))  # Yoshida's weights: three leapfrog steps of w1 dt, w0 dt, w1 dt make a 4th-order step
W0 = -2 ** (1 / 3) * W1


def yoshida(h, q, k, dt):  # three self-contained leapfrog steps: 6 forces, 12 vector ops a step
    q, k = M.leapfrog(h, q, k, W1 * dt)
    q, k = M.leapfrog(h, q, k, W0 * dt)
    return M.leapfrog(h, q, k, W1 * dt)


def test_a_yoshida_integrator_added_through_the_tables_alone_trains_is_priced_and_is_fourth_order(monkeypatch):
    # a forker's new integrator: one entry of INTEGRATORS, one of QK_TRANSFORMS (each force), no edit of model.py
    name = new_name('yoshida')
    monkeypatch.setitem(INTEGRATORS, name, Integrator(yoshida, True, True, True, order=4, forces=6, vector_ops=12))
    monkeypatch.setitem(QK_TRANSFORMS, name, M.dynamics(name))
    monkeypatch.setitem(QK_TRANSFORMS, name + '-mlp', M.dynamics(name, 'mlp', width=lambda m: m // 2))
    losses = adamw_losses(build(name))
    assert losses[-2] < losses[0] - 0.2
    for entry in (name, name + '-mlp'):
        for steps in (1, 3):
            counted, priced = counted_and_priced_matmul_flops(entry, steps)
            assert counted == priced
            test_every_entrys_elementwise_price_is_what_is_counted(entry, steps)
        for claim in CLAIMS:  # symplectic only with the potential; order 4 with either force
            test_each_entry_keeps_what_it_promises(entry, claim)
    assert not QK_TRANSFORMS[name + '-mlp'].symplectic and QK_TRANSFORMS[name + '-mlp'].order == 4
    cost = lambda attn: flops_per_token(GPTConfig(attn=attn, **PRESETS['60m']), 512) / flops_per_token(
        GPTConfig(**PRESETS['60m']), 512) - 1
    assert 0.014 < cost(name) < 0.016 and 0.004 < cost('coupled') < 0.006  # +1.5% and +0.5% at 60m


def test_q_k_parameters_are_found_wherever_the_module_sits():
    # a forker's shared potential, attached to the GPT instead of a layer, is still counted and not decayed
    m = build('standard')
    m.shared = Hamiltonian(4, 8, 12, 1)
    assert {id(p) for p in m.qk_parameters()} == {id(p) for p in m.shared.parameters()}
    opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decayed = {id(p) for g in opt.param_groups if g['weight_decay'] > 0 for p in g['params']}
    assert not decayed & {id(p) for p in m.shared.parameters()}


def test_train_py_takes_every_model_default_it_does_not_set_from_gptconfig():
    r = run('train.py', '--help')
    shown = dict(re.findall(r'^  --(\w+)=(.*)$', r.stdout, re.M))
    laptop = {'n_layer', 'n_head', 'n_embd', 'block_size'}  # the laptop shape train.py writes down
    for f in dataclasses.fields(GPTConfig):
        if f.name not in laptop | {'vocab_size'}:
            assert shown[f.name] == str(f.default), f.name  # qk_decay included: model, optimizer, trainer agree
    assert not GPTConfig().qk_decay


# ===============================================================================================================
# the scripts, run the way a user runs them

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish? \u00e9\u00e8\u2014 caf\u00e9\n") * 40


# Every run of a script is a process of its own, as `python script args` is: its own pid, argv, working folder,
# environment, stdout and stderr pipes, exit code and signals. On Linux it is forked by multiprocessing's fork
# server, a warm Python that has already imported what the scripts import (torch, and the torch._dynamo that AdamW
# loads: seconds each time), so a run costs a fork, not those imports. Elsewhere, and where a run's environment sets
# a PYTHON* variable (read only when an interpreter starts), it is a fresh interpreter.

RUN = r"""
import json, os, runpy, signal, sys, threading, traceback
def run(r, *ends):  # `python *r['argv']` in this process (forked, or fresh), after the python code r['patch']
    argv, code = r['argv'], 0
    try:
        if ends:  # forked: the run's own stdout and stderr, and what a fresh interpreter has
            for end, fd in zip(ends, (1, 2)):
                os.dup2(end.fileno(), fd), end.close()
            sys.path[1:] = r['path']
            import multiprocessing
            multiprocessing.set_start_method(None, force=True)
        os.chdir(r['cwd'])
        os.environ.update(r['env'])
        signal.signal(signal.SIGINT, signal.SIG_IGN if r['sigint_ignored'] else signal.default_int_handler)
        if r['fsize']:  # files capped at this many bytes: a write past it fails as on a full disk
            import resource
            resource.setrlimit(resource.RLIMIT_FSIZE, (r['fsize'], r['fsize']))
        if argv[0] == '-c':
            sys.argv, sys.path[0] = ['-c', *argv[2:]], ''
            main = lambda: exec(compile(argv[1], '<string>', 'exec'), {'__name__': '__main__'})
        elif argv[0] == '-m':
            sys.argv, sys.path[0] = argv[1:], os.getcwd()
            main = lambda: runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            main = lambda: runpy.run_path(argv[0], run_name='__main__')
        for name in ('model', 'prepare_data'):  # imported already: kept where the script would import that file
            mine = os.path.join(sys.path[0], name + '.py')
            if name in sys.modules and not (os.path.isfile(mine)
                                            and os.path.samefile(mine, sys.modules[name].__file__)):
                del sys.modules[name]
        exec(r['patch'], {'__name__': '__patch__'})
        main()
    except SystemExit as e:  # as the interpreter does: an int is the exit code, a string goes to stderr
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException as e:
        traceback.print_exc()
        code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    threading._shutdown()  # then as at the interpreter's exit: threads joined, atexit, streams flushed
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    if code == -signal.SIGINT:  # an uncaught Ctrl-C ends the interpreter by that signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
"""
FORK = sys.platform == 'linux'  # macOS: forking after torch's import is unsafe
FORKS = threading.Lock()  # multiprocessing reads a run's exit code once: one thread at a time starts or asks
os.environ['OMP_NUM_THREADS'] = '1'  # one thread in each process the tests start (this one's torch has read it)
if FORK:
    SERVER = multiprocessing.get_context('forkserver')
    SERVER.set_forkserver_preload(['numpy', 'torch', 'torch.distributed', 'torch.nn.parallel', 'torch._dynamo',
                                   'model', 'prepare_data',  # what train.py imports, and what AdamW does
                                   'pytest'])  # (under `pytest`, each fork first re-runs that script: its import)
    FRESH_PATH = json.loads(subprocess.check_output(  # a fresh interpreter's import path, after its first entry
        [sys.executable, '-c', 'import json, sys; print(json.dumps(sys.path[1:]))']))

class Forked:
    """A run forked by the fork server, used as a subprocess.Popen is (it is the server's child, not ours)."""

    def __init__(self, request):
        (out, out_w), (err, err_w) = os.pipe(), os.pipe()
        ends = [multiprocessing.connection.Connection(w, readable=False) for w in (out_w, err_w)]
        code, names = RUN + 'run(r, *ends)', dict(r=dict(request, path=FRESH_PATH), ends=ends)
        self.process = SERVER.Process(target=exec, args=(code, names))  # exec(code, names), in the fork
        with FORKS:
            self.process.start()  # (the write ends go to the fork as file descriptors)
        for end in ends:
            end.close()
        self.args, self.pid, self.returncode = request['argv'], self.process.pid, None
        self.stdout, self.stderr = open(out, errors='replace'), open(err, errors='replace')

    def poll(self):
        with FORKS:
            self.returncode = self.process.exitcode  # minus the signal that ended it, as subprocess says
        return self.returncode

    def wait(self, timeout=None):
        if not multiprocessing.connection.wait([self.process.sentinel], timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def send_signal(self, sig):
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # (it may end meanwhile)
                os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=None):
        texts = {}
        reads = [threading.Thread(target=lambda f=f: texts.setdefault(f, f.read()), daemon=True)
                 for f in (self.stdout, self.stderr)]  # both pipes read at once: either may fill
        for t in reads:
            t.start()
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send_signal(signal.SIGTERM)  # torchrun stops its workers (which hold the pipes too) on SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(10)
            self.kill()
            raise
        for t in reads:  # (a run's own children may still hold its pipes)
            t.join(timeout)
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.stdout.close(), self.stderr.close()
        return texts[self.stdout], texts[self.stderr]


@pytest.fixture(scope='session', autouse=True)
def no_run_outlives_the_tests():
    yield
    with FORKS:
        for p in multiprocessing.active_children():  # left by a test that failed
            p.kill()


def start(*argv, cwd=HERE, env=None, patch='', sigint_ignored=False, fsize=0):
    """`python *argv` (a script and its arguments, or -c code, or -m module), started; a Popen. patch: python code
    run first (e.g. to make the checkpoint write slow); sigint_ignored: as a shell's background job inherits it."""
    request = dict(argv=[os.fsdecode(a) for a in argv], cwd=str(cwd), env=env or {}, patch=patch,
                   sigint_ignored=sigint_ignored, fsize=fsize)
    if FORK and not any(k.startswith('PYTHON') for k in request['env']):
        return Forked(request)
    return subprocess.Popen([sys.executable, '-c', RUN + 'run(json.loads(sys.argv[1]))', json.dumps(request)],
                            cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors='replace', env=dict(os.environ, **request['env']))


def run(*argv, timeout=240, **kw):
    """`python *argv`, run to its end; a CompletedProcess."""
    p = start(*argv, **kw)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def scripts(*calls, **kw):  # each call (script, arg, ...) run, one after another
    return [run(*call, **kw) for call in calls]


def side_by_side(*calls, **kw):  # independent calls, two at a time (two cores); their results in order
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: run(*call, **kw), calls))


def one_line_error(r, words):
    err = r.stderr.strip()
    return r.returncode != 0 and 'Traceback' not in r.stderr and '\n' not in err and words in err


def tabulate(capsys, *folders):
    """python results/report.py FOLDERS in this process: (exit code, stdout, stderr)."""
    try:
        report.main([str(f) for f in folders])
        code = 0
    except SystemExit as e:  # sys.exit('error: ...'): Python prints the line and exits with 1
        code = print(e.code, file=sys.stderr) or 1 if isinstance(e.code, str) else e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def report_rows(stdout, table=0):  # the rows of the first table (the results)
    return {row.split(' | ')[1]: row.split(' | ') for row in stdout.split('\n\n')[table].splitlines()
            if row.startswith('| pydocs')}



PROBE = """
import atexit, multiprocessing, os, signal, sys, threading, time, model
printed = threading.Event()  # the thread prints after the main line (no race with a slow main thread), still at exit
threading.Thread(target=lambda: (printed.wait(), time.sleep(0.2), print('a thread, joined'))).start()
atexit.register(print, 'atexit ran')
print(sys.argv, os.getcwd(), os.environ['X'], sys.path, multiprocessing.get_start_method(), model.__file__,
      repr(sys.stdin.read()), signal.getsignal(signal.SIGINT), sys.flags)
print('to stderr', file=sys.stderr)
printed.set()
sys.exit(3)
"""


def test_a_run_is_what_python_gives_a_user_and_stops_as_it_does(tmp_path):
    (tmp_path / 'probe.py').write_text(PROBE)
    (tmp_path / 'model.py').write_text('')  # not the model.py the fork server imported: the run imports this one
    forms = [(form, {'X': 'y'}) for form in (['probe.py'], ['-c', PROBE], ['-m', 'probe'])]
    for form, env in forms + [(['-c', PROBE], {'X': 'y', 'PYTHONHASHSEED': '0'})]:  # forked; the last, fresh
        fresh = subprocess.run([sys.executable, *form, 'a b'], cwd=tmp_path, env=dict(os.environ, **env),
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,  # as from a shell's
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # foreground
        r = run(*form, 'a b', cwd=tmp_path, env=env)
        assert (r.returncode, r.stdout, r.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), (form, env)
        assert fresh.returncode == 3 and fresh.stdout.endswith('a thread, joined\natexit ran\n')
    sleeper = ('-c', "import time; print('up', flush=True); time.sleep(60)")
    p = start(*sleeper)
    assert p.stdout.readline() == 'up\n' and p.pid != os.getpid()  # read while it runs
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGINT and err.rstrip().endswith('KeyboardInterrupt'), err
    p = start(*sleeper, sigint_ignored=True)
    p.stdout.readline(), p.send_signal(signal.SIGINT)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.5)  # ignored, as a shell's background job ignores it
    p.kill()
    assert p.communicate(timeout=30) == ('', '') and p.returncode == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        run(*sleeper, timeout=0.5)  # then stopped: SIGTERM, and SIGKILL if that is not enough



def read_bin(path):
    return np.fromfile(path, dtype=np.uint16)


PREPARED = {}  # corpus: {split: sha256 of its token file}, as prepared in full


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A small real corpus: Python's own docs (offline), bytes tokenizer, cut to 300k/8k tokens so runs are quick."""
    d = tmp_path_factory.mktemp('data')
    meta = prepare_data.prepare('pydocs', data_dir=str(d))
    PREPARED['pydocs'] = {s: prepare_data.sha256_of(d / 'pydocs' / f'{s}.bin') for s in meta['tokens']}
    for split, n in (('train', 300_000), ('val', 8_000)):
        tokens = read_bin(d / 'pydocs' / f'{split}.bin')[:n]
        tokens.tofile(d / 'pydocs' / f'{split}.bin')
        meta['tokens'][split], meta['bytes'][split] = len(tokens), int((tokens != 256).sum())  # 256: end of text
    meta['fingerprint'] = prepare_data.fingerprint({s: d / 'pydocs' / f'{s}.bin' for s in meta['tokens']})
    (d / 'pydocs' / 'meta.json').write_text(json.dumps(meta))
    return str(d)


# ---------------------------------------------------------------------------------------------------------------
# prepare_data.py

def test_prepare_round_trip_bytes(tmp_path):
    src = tmp_path / 'play.txt'
    src.write_text(TEXT, encoding='utf-8')
    meta = prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path / 'data'), tokenizer='bytes')
    out = tmp_path / 'data' / 'play'
    train, val = read_bin(out / 'train.bin'), read_bin(out / 'val.bin')
    assert meta['tokens'] == {'train': len(train), 'val': len(val)} and meta['vocab_size'] == 257
    assert train[-1] == 256 and val[-1] == 256 and 0.05 < len(val) / (len(train) + len(val)) < 0.15
    decoded = bytes(train[:-1].astype(np.uint8)) + bytes(val[:-1].astype(np.uint8))
    assert decoded.decode('utf-8') == TEXT
    assert meta['bytes'] == {'train': len(train) - 1, 'val': len(val) - 1}  # the text's UTF-8 bytes, for bits/byte
    assert json.load(open(out / 'meta.json')) == meta and meta['tokenizer'] == 'bytes'


def test_prepare_round_trip_gpt2_through_offline_cache(tmp_path):
    if not os.environ.get('TIKTOKEN_CACHE_DIR'):
        pytest.skip('TIKTOKEN_CACHE_DIR is not set: the gpt2 tokenizer would need the network')
    import tiktoken
    docs = [{'text': f"Abstract {i:02}: coupled dynamics of queries and keys, trial {i:02}.\n" * 3} for i in range(30)]
    src = tmp_path / 'abstracts.jsonl'
    src.write_text('\n'.join(json.dumps(d) for d in docs) + '\n')
    meta = prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path / 'data'), tokenizer='gpt2')
    assert meta['vocab_size'] == 50257
    out = tmp_path / 'data' / 'abstracts'
    enc = tiktoken.get_encoding('gpt2')
    tokens = np.concatenate([read_bin(out / 'train.bin'), read_bin(out / 'val.bin')]).tolist()
    assert tokens.count(50256) == len(docs)  # one end-of-text after every document
    texts = enc.decode(tokens).split('<|endoftext|>')[:-1]
    assert sorted(texts) == sorted(d['text'] for d in docs)


def test_prepare_keeps_finished_work_and_refuses_other_text_under_its_name(tmp_path):
    src = tmp_path / 'play.txt'
    src.write_text(TEXT)
    prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path))
    stamp = os.path.getmtime(tmp_path / 'play' / 'train.bin')
    same = run('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path}')
    assert same.returncode == 0 and 'already prepared' in same.stdout
    assert os.path.getmtime(tmp_path / 'play' / 'train.bin') == stamp
    src.write_text(TEXT * 2)  # the same file, other text: a run trained on the old one must not meet it silently
    other, forced = scripts(('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path}'),
                            ('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path}', '--force'))
    assert one_line_error(other, 'holds play prepared otherwise (input_sha256 differs); --force replaces it')
    assert forced.returncode == 0 and len(read_bin(tmp_path / 'play' / 'train.bin')) > len(TEXT) * 1.5


def test_a_corpus_not_prepared_names_the_command_that_prepares_it_where_the_run_looks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (no data/ here)
    for data_dir, name, command in (('data', 'pydocs', 'python prepare_data.py pydocs'),
                                    (str(tmp_path / 'my data'), 'web', f"python prepare_data.py web "
                                                                       f"--data_dir='{tmp_path / 'my data'}'"),
                                    ('data', 'mine', 'python prepare_data.py --input=PATH --name=mine')):
        with pytest.raises(prepare_data.DataError) as e:
            prepare_data.load(data_dir, name, 32)
        assert str(e.value).endswith(f"not found; prepare the corpus first: {command}"), e.value


@pytest.mark.parametrize('docs', [['a' * 10_000, 'b\n' * 45_000], ['Title\n', 'x' * 60_000], ['', 'word ' * 400],
                                  ['one line\n' * 500], ['same\n' * 100] * 40])
@pytest.mark.parametrize('val_fraction', [0.1, 0.3])
def test_splits_hold_val_fraction_of_the_text_within_the_tolerance(docs, val_fraction):
    if len(docs) == 2 and docs[0] == 'Title\n':  # one document of a title line and 60 KB without line ends
        docs = [''.join(docs)]
    splits = prepare_data.split_train_val(docs, val_fraction)
    train, val = (''.join(splits[s]) for s in ('train', 'val'))
    assert sorted(train + val) == sorted(''.join(docs))  # every character once
    assert abs(len(val) / len(train + val) - val_fraction) <= prepare_data.TOLERANCE * val_fraction


@pytest.mark.parametrize('tokenizer', ['bytes', 'gpt2'])
def test_the_val_fraction_is_measured_in_the_tokens_the_model_sees(tmp_path, tokenizer):
    if tokenizer == 'gpt2' and not os.environ.get('TIKTOKEN_CACHE_DIR'):
        pytest.skip('TIKTOKEN_CACHE_DIR is not set: the gpt2 tokenizer would need the network')
    os.makedirs(tmp_path / 'docs')  # nine ASCII documents and one CJK: a tenth of the characters is a quarter of
    for i in range(10):  # the tokens in either tokenizer
        (tmp_path / 'docs' / f'{i}.txt').write_text(f"document {i}: the quick brown fox.\n" * 60 if i < 9 else
                                                     '\u6f22\u5b57\u306e\u6587\u66f8\u3002\n' * 330)
    meta = prepare_data.prepare(None, input=str(tmp_path / 'docs'), data_dir=str(tmp_path), tokenizer=tokenizer)
    share = meta['tokens']['val'] / (meta['tokens']['train'] + meta['tokens']['val'])
    assert abs(share - 0.1) <= prepare_data.TOLERANCE * 0.1, share
    assert meta['val_fraction'] == 0.1 and meta['val_fraction_measured'] == round(share, 4)


PINNED = {  # sha256 of the corpora's token files (README and results/), as prepared since their runs were made
    'shakespeare': ('tinyshakespeare/input.txt', 'f15494575ff4787ada05a2f612ca4aed7bc4ff26df0f824c2832b3051c7889aa',
                    'c05585963b772a0c69463c68b510fe39e162322d6f30b0c3a297f2ebc250f818'),
    'pubmed': ('pubmed/ori_pqal.json', '4e85f43e2913355a9171a66c0ee1cd1a1003b27d27805ccb8bf953f5108dceb3',
               '305a4e61b5eb726da0800cf796f8b9efaa9c8d355c9282a9ef2cbbad3bacbfde'),
    'web': ('web/c4-sample.00000-of-00001.json.gz', '12e9563bd61f85f27878c3c1f13ce5d25fb801b4a0e111566b8b4275e7a1a5c4',
            '70ca8d58f88308201d1d39ae0c460d65fa7e4f2df4cc433b75cb556c79c55f1a'),
    'wikitext': ('wikitext-2-raw/wiki.test.raw', '0780526de77f2da6c9de839f33f0b7c7f3befee877237d586586629c23e2a54e',
                 '8320123a7600473378787115cefd9883655558eacba9cd0b0c06e2e9f09df3f2'),  # an --input, CRLF read as LF
    'pydocs': ('3.11.7', 'e931b7c5241eb0b313934b87cfe34e55594796c8903f50302c31f1953eeff005',  # this Python's docs
               '5532d1eb6ee1913bd0a0f3efe51f7af87c0df2d95999249766c710f078fb3446'),
}


@pytest.mark.parametrize('name', PINNED)
def test_the_corpora_split_as_they_always_did(corpus, tmp_path, name):
    # WikiText-103 comes split: its splits are the archive's files, as test_wikitext_zip_with_the_archives_layout checks
    source, *want = PINNED[name]
    if name == 'pydocs':
        if platform.python_version() != source:
            pytest.skip(f"pydocs is pinned for Python {source}'s docs")
        assert [PREPARED['pydocs'][s] for s in ('train', 'val')] == want
        return
    path = os.path.join(os.environ.get('CORPORA_DIR', ''), source)  # offline copies of the sources (.ci/run sets it)
    if not os.environ.get('CORPORA_DIR') or not os.path.exists(path):
        pytest.skip(f"no offline copy of {name}'s source: set CORPORA_DIR to a folder that holds {source}")
    meta = prepare_data.prepare(None if name == 'wikitext' else name, input=path, name=name, data_dir=str(tmp_path))
    assert [prepare_data.sha256_of(tmp_path / name / f'{s}.bin') for s in ('train', 'val')] == want
    assert meta['fingerprint'] == prepare_data.fingerprint({s: tmp_path / name / f'{s}.bin' for s in meta['tokens']})


@pytest.mark.parametrize('args, words', [
    (['nocorpus'], "unknown corpus 'nocorpus'; choose one of pydocs"), (['--input=MISSING'], 'does not exist'),
    (['--input=BAD'], "bad.jsonl:2 is not a JSON object with a string field 'text'"),
    (['--input=SMALL'], 'val split would hold only 30 tokens, too few to train or evaluate on (at least 64); give '
                        'more text or a larger --val_fraction'),
    (['--val_fraction=1.5'], '--val_fraction must be between 0 and 1'), (['--tokenizer=words'], "invalid choice"),
])
def test_prepare_bad_input_gives_one_line(tmp_path, args, words):
    (tmp_path / 'bad.jsonl').write_text('{"text": "fine"}\n{"title": "no text"}\n')
    (tmp_path / 'small.txt').write_text('x' * 300)  # val: 29 bytes and its end of text, a tenth of 301 tokens
    files = dict(MISSING='missing.txt', BAD='bad.jsonl', SMALL='small.txt')
    args = [a.replace(k, str(tmp_path / f)) for a in args for k, f in files.items() if k in a] or args
    r = run('prepare_data.py', *args, f'--data_dir={tmp_path / "data"}')
    assert one_line_error(r, words), r.stderr
    assert not glob.glob(str(tmp_path / 'data' / '*' / 'meta.json'))


# The paper's other corpora, through the real download path from a local server: fixtures in the files' formats

def pubmed_fixture():
    entries = {str(30000000 + i): dict(QUESTION=f"Does coupling help {i}?", CONTEXTS=[f"Background {i}. " * 20,
               f"Methods {i}: a trial of queries and keys. " * 10], LONG_ANSWER=f"Coupling helped in case {i}.",
               YEAR='2018') for i in range(40)}
    return json.dumps(entries).encode(), entries


def web_fixture():
    docs = [dict(text=f"Shop page {i}: buy {i} widgets today! Free shipping.\n" * (i % 7 + 3), url=f'http://x/{i}',
                 date='2019-04-20') for i in range(60)]
    return gzip.compress(''.join(json.dumps(d) + '\n' for d in docs).encode()), docs


@pytest.fixture
def server(tmp_path):
    """Serve tmp_path/www over HTTP on a local port; yields (base url, folder)."""
    www = tmp_path / 'www'
    www.mkdir()
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(www), **k)
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f'http://127.0.0.1:{httpd.server_address[1]}', www
    httpd.shutdown()


@pytest.mark.parametrize('name', ['pubmed', 'web'])
def test_paper_corpora_download_check_and_parse(tmp_path, server, monkeypatch, name):
    url, www = server
    blob, items = pubmed_fixture() if name == 'pubmed' else web_fixture()
    fn = 'ori_pqal.json' if name == 'pubmed' else 'c4-sample.00000-of-00001.json.gz'
    (www / fn).write_bytes(blob)
    monkeypatch.setitem(prepare_data.CORPORA, name, dict(prepare_data.CORPORA[name], url=f'{url}/{fn}',
                                                          sha256=hashlib.sha256(blob).hexdigest()))
    meta = prepare_data.prepare(name, data_dir=str(tmp_path / 'data'))
    out = tmp_path / 'data' / name
    tokens = np.concatenate([read_bin(out / 'train.bin'), read_bin(out / 'val.bin')])
    texts = sorted(bytes(t.astype(np.uint8)).decode() for t in np.split(tokens, np.where(tokens == 256)[0] + 1)[:-1]
                   for t in [t[:-1]])
    want = sorted('\n'.join(e['CONTEXTS'] + [e['LONG_ANSWER']]) for e in items.values()) if name == 'pubmed' \
        else sorted(d['text'] for d in items)
    assert texts == want and meta['corpus'] == name
    assert (out / fn).read_bytes() == blob  # the download is kept next to the tokens
    # a file that changed upstream fails the checksum: one line, nothing left behind
    monkeypatch.setitem(prepare_data.CORPORA, name, dict(prepare_data.CORPORA[name], sha256='0' * 64))
    with pytest.raises(prepare_data.DataError, match='does not have the expected sha256'):
        prepare_data.prepare(name, data_dir=str(tmp_path / 'other'))
    assert not (tmp_path / 'other' / name / fn).exists() and not (tmp_path / 'other' / name / 'meta.json').exists()


def test_wikitext_zip_with_the_archives_layout(tmp_path, server, monkeypatch):
    import zipfile
    url, www = server
    with zipfile.ZipFile(www / 'wikitext-2-raw-v1.zip', 'w') as z:
        for split in ('train', 'valid', 'test'):
            z.writestr(f'wikitext-2-raw/wiki.{split}.raw', f' = Heading {split} = \n\n Text of {split}. \n' * 50)
    monkeypatch.setitem(prepare_data.CORPORA, 'wikitext2', dict(prepare_data.CORPORA['wikitext2'],
                                                                 url=f'{url}/wikitext-2-raw-v1.zip'))
    meta = prepare_data.prepare('wikitext2', data_dir=str(tmp_path / 'data'), tokenizer='bytes')
    assert set(meta['tokens']) == {'train', 'val', 'test'}
    val = read_bin(tmp_path / 'data' / 'wikitext2' / 'val.bin')
    assert bytes(val[:-1].astype(np.uint8)).decode() == ' = Heading valid = \n\n Text of valid. \n' * 50


def test_offline_named_corpus_fails_in_one_line_and_local_copy_works(tmp_path):
    r = run('-c', 'import prepare_data, sys; '
            'prepare_data.CORPORA["pubmed"]["url"] = "http://127.0.0.1:9/ori_pqal.json"; '
            f'sys.argv = ["prepare_data.py", "pubmed", "--data_dir={tmp_path / "data"}"]; '
            'exec(open("prepare_data.py").read())')
    assert r.returncode != 0 and 'Traceback' not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert '--input=<path to ori_pqal.json>' in r.stderr and not (tmp_path / 'data' / 'pubmed' / 'meta.json').exists()
    blob, items = pubmed_fixture()
    (tmp_path / 'ori_pqal.json').write_bytes(blob)
    r = run('prepare_data.py', 'pubmed', f'--input={tmp_path / "ori_pqal.json"}', f'--data_dir={tmp_path / "data"}')
    assert r.returncode == 0 and 'is not byte for byte' in r.stdout  # a fixture, not the real file: said, then used
    assert json.load(open(tmp_path / 'data' / 'pubmed' / 'meta.json'))['corpus'] == 'pubmed'


# ---------------------------------------------------------------------------------------------------------------
# train.py. Its promises: G1, no run lost; G2, exact resume; G3, never silently wrong; G4, one clear line for a
# plausible mistake. Each test names the one it holds.

SMALL = ['--n_layer=2', '--batch_size=4', '--block_size=32', '--eval_iters=2', '--log_interval=1', '--sample_tokens=0']

def train(corpus, out_dir, *args, timeout=240, **kw):  # one train.py in a process of its own
    return run('train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}', *SMALL, *args, timeout=timeout, **kw)


def trains(corpus, out_dir, *args):  # train.py and its arguments, for run(), start(), scripts()
    return ('train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}', *SMALL, *args)


def metrics(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, 'metrics.jsonl'))]


def test_G2_resume_continues_and_reproduces_the_uninterrupted_run(corpus, tmp_path):
    common = ['--max_iters=12', '--lr_decay_iters=12', '--warmup_iters=2', '--eval_interval=6', '--attn=coupled',
              '--dropout=0.1']
    a, b = tmp_path / 'a', tmp_path / 'b'
    ra, rb, r = scripts(trains(corpus, a, *common), trains(corpus, b, *common, '--max_iters=6'),  # "interrupted"
                        trains(corpus, b, *common, '--init_from=resume'))
    assert ra.returncode == rb.returncode == 0, ra.stderr + rb.stderr
    assert r.returncode == 0 and 'resuming' in r.stdout and 'at iteration 6' in r.stdout
    trained = lambda d: {m['iter']: m['loss'] for m in metrics(d) if m['event'] == 'train'}
    ta, tb = trained(a), trained(b)
    assert sorted(tb) == list(range(1, 13))  # the count continued from 7, not from 1
    assert all(tb[i] == pytest.approx(ta[i], abs=1e-6) for i in range(7, 13))
    evals = lambda d: [m['iter'] for m in metrics(d) if m['event'] == 'eval']
    assert evals(b) == evals(a) == [0, 6, 12]  # the log holds each eval once, in order
    final = lambda d: [m for m in metrics(d) if m['event'] == 'final'][-1]
    assert final(b)['val_loss'] == pytest.approx(final(a)['val_loss'], abs=1e-6)
    assert final(b)['tokens'] == final(a)['tokens'] == 12 * 4 * 32  # tokens trained, across the resume
    assert [m['event'] for m in metrics(b)].count('final') == 2  # the 6-iteration run's result was kept
    ckpt = torch.load(b / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 12 and ckpt['tokens'] == 12 * 4 * 32
    assert not any(k.startswith('_orig_mod.') for k in ckpt['model'])



def test_G3_resume_and_eval_take_every_setting_from_the_checkpoint(corpus, tmp_path):
    # a non-default shape, block_size and dataset; then resume and evaluate with no flags but where the run is
    other = tmp_path / 'data'
    src = tmp_path / 'play.txt'
    src.write_text(TEXT * 10)
    prepare_data.prepare(None, input=str(src), data_dir=str(other))
    out = tmp_path / 'run'
    r, resumed, ev, clash = scripts(
        ('train.py', f'--data_dir={other}', '--dataset=play', f'--out_dir={out}', '--n_layer=1', '--n_embd=48',
         '--n_head=3', '--block_size=40', '--batch_size=3', '--max_iters=4', '--eval_interval=2', '--eval_iters=1'),
        ('train.py', f'--out_dir={out}', '--init_from=resume', '--max_iters=6'),
        ('train.py', f'--out_dir={out}', '--eval_only=True'),
        ('train.py', f'--out_dir={out}', '--eval_only=True', '--block_size=64'))
    assert r.returncode == 0 and resumed.returncode == 0, r.stderr + resumed.stderr
    assert 'at iteration 4' in resumed.stdout and 'play: 257 token vocabulary' in resumed.stdout
    assert torch.load(out / 'ckpt.pt', weights_only=True)['config']['block_size'] == 40
    n_val = json.load(open(other / 'play' / 'meta.json'))['tokens']['val']
    assert ev.returncode == 0 and f"({n_val:,} tokens)" in ev.stdout  # play's val split, not pydocs'
    # a flag that contradicts the checkpoint's model is refused in one line naming it
    assert one_line_error(clash, '--block_size=64 here but 40 in the checkpoint')



def test_G3_every_validation_token_is_scored_once_as_an_independent_computation_does(corpus, tmp_path):
    r, ev = scripts(trains(corpus, tmp_path, '--max_iters=3', '--eval_interval=3', '--attn=coupled'),
                    ('train.py', f'--out_dir={tmp_path}', '--eval_only=True'))
    assert r.returncode == 0, r.stderr
    final = [m for m in metrics(tmp_path) if m['event'] == 'final'][0]
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']), verbose=False)
    model.load_state_dict(ckpt['model'])
    model.eval()
    data = torch.from_numpy(read_bin(os.path.join(corpus, 'pydocs', 'val.bin')).astype(np.int64))
    n = (len(data) - 1) // 32 * 32  # whole windows of 32, then the short last one
    windows = [(data[:n].view(-1, 32), data[1:n + 1].view(-1, 32)), (data[n:-1][None], data[n + 1:][None])]
    nats, count = 0.0, 0
    with torch.no_grad():  # every token once, its context from its window's start
        for x, y in windows:
            for i in range(0, len(x), 64):
                logits = model(x[i:i + 64])[0]
                nats += F.cross_entropy(logits.flatten(0, 1), y[i:i + 64].flatten(), reduction='sum').double().item()
                count += y[i:i + 64].numel()
    assert count == len(data) - 1
    assert final['val_loss'] == pytest.approx(nats / count, abs=1e-4)
    assert final['val_ppl'] == pytest.approx(math.exp(final['val_loss']))
    n_bytes = json.load(open(os.path.join(corpus, 'pydocs', 'meta.json')))['bytes']['val']
    assert final['val_bpb'] == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-4)
    line = [x for x in ev.stdout.splitlines() if x.startswith('full val split')][0]
    assert float(re.search(r'loss ([\d.]+)', line).group(1)) == pytest.approx(nats / count, abs=1e-4)
    assert 'bits per byte' in line



def test_training_lowers_validation_loss_and_logs_progress_the_coupling_and_attention(corpus, tmp_path):
    r = train(corpus, tmp_path, '--max_iters=40', '--eval_interval=20', '--attn=coupled', '--learning_rate=1e-3',
              '--warmup_iters=10', '--dropout=0')  # (dropout 0 is a valid float: 0 once was refused)
    assert r.returncode == 0
    line = [x for x in r.stdout.splitlines() if x.startswith('iter 40/40')][0]
    assert all(w in line for w in ('loss', 'lr', 'ms/iter', 'tok/s', 'eta')) and '| mfu' not in line  # CPU: no MFU
    first = [x for x in r.stdout.splitlines() if x.startswith('iter 1/40')][0]
    assert first.endswith(' | eta -') and re.search(r' \| eta [\d.]+ min$', line), (first, line)  # none from 1 step
    assert 'q/k map: nonlinear' in r.stdout
    evals = [m for m in metrics(tmp_path) if m['event'] == 'eval']
    assert len(evals) == 3 and evals[-1]['val_loss'] < evals[0]['val_loss'] - 1.0
    for e in evals:  # every eval carries the per-layer coupling diagnostic, with the step sizes
        assert len(e['qk']) == 2 and all(len(s['dt']) == 4 and 0 <= s['nonlinear'] for s in e['qk'])
    # and the attention diagnostics: per layer, those of the saved model on the first sequences of the diagnostics'
    # batch (8,192 val tokens, seed 10,000), whatever --batch_size
    step = [x for x in r.stdout.splitlines() if x.startswith('step 40:')][0]
    att = evals[-1]['attn']
    assert f"attention: entropy {np.median([s['entropy'] for s in att]):.2f}, sink " in step
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']), verbose=False)
    model.load_state_dict(ckpt['model'])
    data = read_bin(os.path.join(corpus, 'pydocs', 'val.bin'))
    ix = torch.randint(len(data) - 32 - 1, (M.DIAG_SEQUENCES,), generator=torch.Generator().manual_seed(10_000))
    x = torch.stack([torch.from_numpy(data[i:i + 32].astype(np.int64)) for i in ix])
    assert att == [pytest.approx(s, abs=1e-6) for s in M.attention_diagnostics(model, x)]
    assert len(att) == 2 and att != evals[0]['attn']  # it moved with training
    assert all(0 <= s[k] <= 1 for e in evals for s in e['attn'] for k in s)



def test_G3_resume_eval_and_sample_refuse_a_checkpoint_of_another_model_or_corpus(tmp_path):
    data, out = tmp_path / 'data', tmp_path / 'out'
    for i, name in enumerate(('a.txt', 'b.txt', 'c.txt')):
        (tmp_path / name).write_text(TEXT[i:] * 3)
    fp = prepare_data.prepare(None, input=str(tmp_path / 'a.txt'), name='sx', data_dir=str(data))['fingerprint']
    prepare_data.prepare(None, input=str(tmp_path / 'c.txt'), name='sy', data_dir=str(data))
    assert train(data, out, '--dataset=sx', '--max_iters=2', '--eval_interval=2', '--attn=coupled').returncode == 0
    assert torch.load(out / 'ckpt.pt', weights_only=True)['fingerprint'] == fp == metrics(out)[0]['fingerprint']
    before = (out / 'ckpt.pt').read_bytes(), (out / 'metrics.jsonl').read_text()
    model, preset, corpus, forced, changed = scripts(
        trains(data, out, '--init_from=resume', '--attn=diff'),
        ('train.py', f'--out_dir={out}', '--eval_only=True', '--preset=small'),
        ('train.py', f'--out_dir={out}', '--eval_only=True', '--dataset=sy'),
        ('prepare_data.py', f'--input={tmp_path / "b.txt"}', '--name=sx', f'--data_dir={data}', '--force'),
        trains(data, out, '--init_from=resume', '--max_iters=4'))
    assert one_line_error(model, "holds a different run: --attn='diff' here but 'coupled' in the checkpoint; drop")
    assert one_line_error(preset, "--preset=small here (n_layer=6, n_head=6, n_embd=384) but n_layer=2, n_head=4, "
                                  "n_embd=128 in the checkpoint")
    assert forced.returncode == 0, forced.stderr
    for r, name in ((corpus, 'sy'), (changed, 'sx')):  # another corpus named, or the run's corpus prepared again
        assert one_line_error(r, f"was trained on other text than {data / name} holds (corpus fingerprint {fp[:12]}, "
                                 "not "), r.stderr
    assert ((out / 'ckpt.pt').read_bytes(), (out / 'metrics.jsonl').read_text()) == before  # G1: refused, untouched
    if os.environ.get('TIKTOKEN_CACHE_DIR'):  # --sample with another tokenizer's corpus
        prepare_data.prepare(None, input=str(tmp_path / 'c.txt'), name='sz', data_dir=str(data), tokenizer='gpt2')
        r = run('train.py', f'--out_dir={out}', '--sample=x', '--dataset=sz')
        assert one_line_error(r, f"reads 257 tokens, {data / 'sz'}'s tokenizer 50257; name the corpus it was trained")


HOLD = """
import os, time, model
forward = model.GPT.forward
def held(self, *a, **k):  # the first training step waits until the file GO exists (and says it waits)
    if self.training and not os.path.exists(GO):
        open(GO + '.waiting', 'w').close()
        while not os.path.exists(GO):
            time.sleep(0.02)
    return forward(self, *a, **k)
model.GPT.forward = held
"""


def test_G1_a_new_run_never_overwrites_a_checkpoint_and_one_trainer_owns_an_out_dir(corpus, tmp_path):
    out, go = tmp_path / 'out', tmp_path / 'go'
    first = start(*trains(corpus, out, '--max_iters=6', '--eval_interval=5', '--seed=1'),
                  patch=HOLD.replace('GO', repr(str(go))))
    wait_for(tmp_path / 'go.waiting')  # training: its out_dir is in use
    try:
        refused = scripts(*[trains(corpus, out, *args) for args in (['--seed=2'], ['--init_from=resume'])])
        assert first.poll() is None  # held: the refusals came while it trained
    finally:
        go.touch()  # whatever happened, the held run goes on
    for r in refused:  # G4: an out_dir in use
        assert one_line_error(r, 'is in use by a running train.py') and f'pid {first.pid}' in r.stderr, r.stderr
    out_, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-2000:]
    log = metrics(out)
    assert [m['config']['seed'] for m in log if m['event'] == 'start'] == [1] and log[-1]['event'] == 'final'
    # a finished run: a scratch run in its folder is refused, and its checkpoint stays
    before = (out / 'ckpt.pt').read_bytes()
    again = train(corpus, out, '--max_iters=6', '--seed=3')
    assert one_line_error(again, 'holds a run; continue it with --init_from=resume, or train in another --out_dir')
    assert (out / 'ckpt.pt').read_bytes() == before and metrics(out) == log
    # its checkpoint deleted by hand, a new run in its folder: the earlier log is kept, not truncated
    os.remove(out / 'ckpt.pt')
    new = train(corpus, out, '--max_iters=1', '--seed=5')
    assert new.returncode == 0 and f"kept as {out / 'metrics.jsonl.1'}" in new.stdout
    assert [json.loads(line) for line in open(out / 'metrics.jsonl.1')] == log
    assert metrics(out)[0]['config']['seed'] == 5
    # started at the same moment on an empty folder: one trains, the other is refused and touches nothing
    both = [start(*trains(corpus, tmp_path / 'new', '--max_iters=6', f'--seed={s}')) for s in (1, 2)]
    ends = [(p.communicate(timeout=240)[1], p.returncode) for p in both]
    assert sorted(code for err, code in ends) == [0, 2]
    err = [err for err, code in ends if code == 2][0].strip()
    assert err.startswith('error:') and ('is in use by a running train.py' in err or 'holds a run' in err), err
    seeds = [m['config']['seed'] for m in metrics(tmp_path / 'new') if m['event'] == 'start']
    assert len(seeds) == 1 and torch.load(tmp_path / 'new' / 'ckpt.pt', weights_only=True)['config']['seed'] == seeds[0]


BAD_FLAGS = [
    (['--attn=hamiltonian'], "--attn=hamiltonian is not one of 'standard', 'coupled'"),
    (['--flux=3'], "'--flux=3' is not a flag; flags look like --key=value; see --help"),
    (['--bacth_size=3'], "'--bacth_size=3' is not a flag; flags look like --key=value, e.g. --batch_size"),
    (['--batch_size=four'], "--batch_size expects an integer, got 'four'"), (['--dropout=zero'], 'expects a number'),
    (['--compile=maybe'], 'True or False'), (['--max_iters', '5'], 'flags look like --key=value'),
    (['--n_head=3'], 'not divisible'), (['--attn=diff', '--n_head=1', '--n_embd=64'], 'even'),
    (['--qk_steps=9'], '1..7'), (['--block_size=10000000'], 'lower --block_size'),
    (['--dataset=nowhere'], 'not found; prepare the corpus first: python prepare_data.py --input=PATH --name=nowhere'),
    (['--init_from=resume'], 'no checkpoint at'), (['--eval_only=True'], 'no checkpoint at'),
    (['--device=cuda'], 'CUDA is not available here'), (['--device=mps'], 'MPS is not available here'),
    (['--device=tpu'], '--device=tpu is unknown'),
]


@pytest.fixture(scope='module')
def bad_flag_runs(corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp('bad_flags')
    calls = [('train.py', f'--data_dir={corpus}', *SMALL, f'--out_dir={d / str(i)}', *args)
             for i, (args, words) in enumerate(BAD_FLAGS)]
    *rs, help = side_by_side(*calls, ('train.py', '--help'))
    return dict(zip([tuple(args) for args, words in BAD_FLAGS], rs)), d, help


@pytest.mark.parametrize('args, words', BAD_FLAGS)
def test_G4_bad_flags_give_one_clear_line(bad_flag_runs, args, words):
    if ('--device=cuda' in args and torch.cuda.is_available()) or ('--device=mps' in args and
                                                                     torch.backends.mps.is_available()):
        pytest.skip('that device is available here')
    r = bad_flag_runs[0][tuple(args)]
    assert one_line_error(r, words) and r.stderr.startswith('error:'), r.stderr
    assert not glob.glob(str(bad_flag_runs[1] / '*' / 'ckpt.pt'))


def test_G4_under_torchrun_a_mistake_is_one_line_from_rank_0(corpus, tmp_path):
    r = run('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', '--device=cpu',
            f'--data_dir={corpus}', '--bacth_size=3')
    assert r.returncode != 0 and r.stderr.count("error: '--bacth_size=3' is not a flag") == 1, r.stderr[-3000:]


def test_help_lists_the_flags(bad_flag_runs):
    r = bad_flag_runs[2]
    assert r.returncode == 0 and '--attn=standard' in r.stdout and '--qk_scale=' in r.stdout


def test_values_written_in_train_py_are_used_unless_a_flag_or_preset_says_otherwise(corpus, tmp_path):
    src = open(os.path.join(HERE, 'train.py')).read()
    for old, new in (("n_layer = 4", "n_layer = 2"), ("max_iters = 2000", "max_iters = 2"),
                     ("eval_iters = 40", "eval_iters = 2"), ("data_dir = 'data'", f"data_dir = {corpus!r}"),
                     ("out_dir = 'out'", f"out_dir = {str(tmp_path / 'a')!r}")):
        assert old in src
        src = src.replace(old, new, 1)
    (tmp_path / 'train.py').write_text(src)
    for name in ('model.py', 'prepare_data.py'):  # beside it, as in the repository
        os.symlink(os.path.join(HERE, name), tmp_path / name)
    a, b = scripts(('train.py',), ('train.py', '--preset=tiny', f'--out_dir={tmp_path / "b"}'), cwd=tmp_path)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert torch.load(tmp_path / 'a' / 'ckpt.pt', weights_only=True)['model_args']['n_layer'] == 2
    assert torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=True)['model_args']['n_layer'] == 4


# ---------------------------------------------------------------------------------------------------------------
# G1: Ctrl-C or SIGTERM, at any moment: one line, exit code 130 (143), a checkpoint being written finished first

def wait_for(path, timeout=120):
    deadline = time.time() + timeout
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(path), f"{path} never appeared"


def stopped_cleanly(p, timeout=60, code=130):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == code, (p.returncode, out[-1000:], err[-2000:])
    assert 'Traceback' not in out + err and 'KeyboardInterrupt' not in out + err, err[-2000:]
    return out.strip().splitlines()[-1], err


@pytest.mark.parametrize('moment', ['import torch', 'setup', 'first eval'])
def test_G1_ctrl_c_during_start_up_stops_with_one_line(corpus, tmp_path, moment):
    # (before train.py's first line runs, the interpreter's own start-up is Python's: no script can reach it)
    if moment == 'import torch' and not os.path.exists('/proc/self/maps'):
        pytest.skip('needs /proc to see the import happen')
    p = subprocess.Popen([sys.executable, 'train.py', f'--data_dir={corpus}', f'--out_dir={tmp_path}', *SMALL],
                         cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1'))
    if moment == 'import torch':  # torch's library is being loaded: the handler is in, torch is not yet
        deadline = time.time() + 60
        while 'libtorch' not in open(f'/proc/{p.pid}/maps').read() and time.time() < deadline:
            time.sleep(0.005)
    else:
        for line in p.stdout:
            if line.startswith('parameters:' if moment == 'setup' else 'step 0:'):
                break
    p.send_signal(signal.SIGINT)
    last, err = stopped_cleanly(p)
    assert last.startswith('interrupted') and err.strip() == ''


def test_G1_train_py_installs_its_ctrl_c_handler_before_its_first_slow_import():
    # a Ctrl-C 30 ms after the start lands in the imports: only a few fast ones of the standard library come first
    for node in ast.parse(open(os.path.join(HERE, 'train.py')).read()).body:
        if 'signal.signal(signal.SIGINT' in ast.unparse(node):
            break
        names = {a.name for a in node.names} if isinstance(node, (ast.Import, ast.ImportFrom)) else set()
        assert names <= {'os', 'shlex', 'signal', 'sys', 'nullcontext', 'suppress'}, f"train.py imports {names} first"
    else:
        raise AssertionError("train.py installs no Ctrl-C handler")


def test_G1_ctrl_c_stops_a_trainer_that_inherited_sigint_ignored(corpus, tmp_path):
    # a background job of a non-interactive shell (sh -c 'python train.py & wait') starts with SIGINT ignored
    p = start(*trains(corpus, tmp_path, '--max_iters=100000', '--eval_interval=5'), sigint_ignored=True)
    wait_for(tmp_path / 'ckpt.pt')
    p.send_signal(signal.SIGINT)
    last, _ = stopped_cleanly(p)
    assert last.startswith('interrupted at iteration') and '--init_from=resume' in last


def test_G1_sigterm_stops_a_run_with_one_line_that_names_its_resume(corpus, tmp_path):
    # kill, a job scheduler's time limit, docker stop: SIGTERM, as Ctrl-C (one line), exit 143 = 128 + 15
    p = start(*trains(corpus, tmp_path, '--max_iters=100000', '--eval_interval=5'))
    wait_for(tmp_path / 'ckpt.pt')
    p.send_signal(signal.SIGTERM)
    last, _ = stopped_cleanly(p, code=143)
    assert last.startswith('terminated at iteration') and '--init_from=resume' in last


SLOW_SAVE = """
import os, pathlib, signal, time, torch
save, replace, calls = torch.save, os.replace, [0]
def slow_save(*a, **k):
    calls[0] += 1
    if calls[0] == 2:  # the second checkpoint (iteration 10) takes a while
        pathlib.Path(FLAG).touch()
        time.sleep(2.5)
    return save(*a, **k)
def replace_then_ctrl_c(src, dst):  # RENAME: a second Ctrl-C right as the new checkpoint takes the old one's place
    replace(src, dst)
    if RENAME and calls[0] == 2:
        os.kill(os.getpid(), signal.SIGINT)
torch.save, os.replace = slow_save, replace_then_ctrl_c
"""


@pytest.mark.parametrize('presses', ['1', '2', '2, the second at the rename'])
def test_G1_ctrl_c_during_a_checkpoint_write_waits_for_it(corpus, tmp_path, presses):
    # once: the checkpoint is finished first, then the run stops; twice: it stops at once, the previous one intact;
    # the second at the rename: the message names the checkpoint on disk
    flag = tmp_path / 'saving'
    patch = SLOW_SAVE.replace('FLAG', repr(str(flag))).replace('RENAME', str('rename' in presses))
    p = patched_train(corpus, tmp_path / 'out', patch, '--max_iters=100000', '--eval_interval=5', popen=True)
    wait_for(flag)
    t0 = time.time()
    for _ in range(1 if presses == '1' or 'rename' in presses else 2):
        p.send_signal(signal.SIGINT)
        time.sleep(0.3)
    last, _ = stopped_cleanly(p)
    ckpt = torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)
    if presses == '1':
        assert ckpt['iter_num'] == 10 and last.startswith('interrupted at iteration 10;') and 'iteration 10:' in last
    elif presses == '2':
        assert time.time() - t0 < 2 and ckpt['iter_num'] == 5 and 'last checkpoint is at iteration 5:' in last
    else:
        assert ckpt['iter_num'] == 10 and 'last checkpoint is at iteration 10:' in last, last
    assert train(corpus, tmp_path / 'out', '--init_from=resume', '--max_iters=12').returncode == 0


SLOW_EVAL = """
import numpy, pathlib, time
fromfile = numpy.fromfile
def slow_fromfile(*a, **k):  # only the full-split evaluation reads a split whole
    pathlib.Path(FLAG).touch()
    time.sleep(4)
    return fromfile(*a, **k)
numpy.fromfile = slow_fromfile
"""


@pytest.mark.parametrize('when', ['final evaluation', 'eval_only', 'sample'])
def test_G1_ctrl_c_during_an_evaluation_or_a_sample(corpus, tmp_path, when):
    out = tmp_path / 'out'
    if when != 'final evaluation':
        assert train(corpus, out, '--max_iters=2').returncode == 0
    flag = tmp_path / 'evaluating'
    patch = SLOW_EVAL.replace('FLAG', repr(str(flag)))
    if when == 'sample':
        slow_generate = 'lambda *a, **k: (pathlib.Path(FLAG).touch(), time.sleep(4))'.replace('FLAG', repr(str(flag)))
        patch = patch.replace('numpy.fromfile = slow_fromfile', f'import model\nmodel.GPT.generate = {slow_generate}')
    extra = {'final evaluation': ['--max_iters=4', '--eval_interval=2'], 'eval_only': ['--eval_only=True'],
             'sample': ['--sample=The ']}[when]
    p = patched_train(corpus, out, patch, *extra, popen=True)
    wait_for(flag)
    p.send_signal(signal.SIGINT)
    last, _ = stopped_cleanly(p)
    if when == 'final evaluation':
        assert last == (f"interrupted at iteration 4; the last checkpoint is at iteration 4: "
                        f"{out / 'ckpt.pt'}. Continue with: python train.py --init_from=resume --out_dir={out}")
        r = train(corpus, out, '--init_from=resume')  # which finishes the evaluation and logs the final record
        assert r.returncode == 0 and metrics(out)[-1]['event'] == 'final'
    else:
        assert last == 'interrupted; nothing was saved'


def test_G1_ctrl_c_says_where_to_resume(corpus, tmp_path):
    out = tmp_path / 'a run'  # a space: the hint quotes it, so it can be pasted
    p = start(*trains(corpus, out, '--max_iters=100000', '--eval_interval=5'))
    wait_for(out / 'ckpt.pt')
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    last, _ = stopped_cleanly(p)
    assert last.startswith('interrupted at iteration') and '--init_from=resume' in last
    command = last.split('Continue with: ')[1]
    assert shlex.split(command)[-1] == f'--out_dir={out}'  # pasted into a shell, it names the folder
    at = torch.load(out / 'ckpt.pt', weights_only=True)['iter_num']  # (a loaded machine gets further than 5)
    r = run(*shlex.split(command)[1:], f'--max_iters={at + 1}')
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------------------------
# train.py: best-only checkpoints, the test split, DDP on two CPU ranks, compile

def test_a_best_only_checkpoint_says_what_it_holds_and_the_final_evaluation_scores_it(corpus, tmp_path):
    out = tmp_path / 'out'
    assert train(corpus, out, '--max_iters=2', '--eval_interval=2').returncode == 0
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    torch.save(ckpt | dict(best_val_loss=1e-3), out / 'ckpt.pt')  # a best estimate that no later one beats
    extended, evaluated = scripts(
        trains(corpus, out, '--init_from=resume', '--max_iters=4', '--eval_interval=1',
               '--always_save_checkpoint=False'), trains(corpus, out, '--eval_only=True'))
    assert extended.returncode == 0, extended.stderr
    assert f"checkpoint {out / 'ckpt.pt'} at iteration 2 (val loss {ckpt['val_loss']:.4f}, the best" in extended.stdout
    final = metrics(out)[-1]
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 2
    assert (final['iter'], final['model_iter'], final['model_tokens']) == (4, 2, ckpt['tokens'])
    assert f"ppl {final['val_ppl']:.3f}" in evaluated.stdout  # --eval_only scores the model the final record scored
    assert "ckpt.pt holds the model of iteration 2\n" in evaluated.stdout  # and says which


def test_non_finite_and_diverging_runs_stop_without_a_traceback(corpus, tmp_path):
    nan, big = scripts(trains(corpus, tmp_path / 'a', '--max_iters=30', '--learning_rate=1e6', '--warmup_iters=0',
                              '--grad_clip=0'),
                       trains(corpus, tmp_path / 'b', '--max_iters=30', '--learning_rate=5', '--warmup_iters=0',
                              '--grad_clip=0', '--eval_interval=10'))
    assert nan.returncode == 3 and one_line_error(nan, 'at iteration') and ('nan' in nan.stderr or 'inf' in nan.stderr)
    # a run that diverges without a NaN: its perplexity is infinite, not an OverflowError
    assert big.returncode in (0, 3) and 'Traceback' not in big.stderr, big.stderr[-2000:]


def test_time_budget_stops_the_run_and_counts_across_a_resume(corpus, tmp_path):
    r, again = scripts(trains(corpus, tmp_path, '--max_iters=100000', '--time_budget=2', '--eval_interval=100000'),
                       trains(corpus, tmp_path, '--init_from=resume'))  # the budget is spent: no more training
    assert r.returncode == 0 and again.returncode == 0, r.stderr + again.stderr
    last = [m for m in metrics(tmp_path) if m['event'] == 'final'][0]
    assert 2 <= last['time'] < 10 and last['iter'] < 100000
    assert [m['iter'] for m in metrics(tmp_path) if m['event'] == 'train'][-1] == last['iter']
    assert [m for m in metrics(tmp_path) if m['event'] == 'final'][-1]['time'] == pytest.approx(last['time'])


def test_test_split_is_evaluated_at_the_end(corpus, tmp_path):
    d = tmp_path / 'data' / 'pydocs'
    os.makedirs(d)
    meta = json.load(open(os.path.join(corpus, 'pydocs', 'meta.json')))
    for f in ('train.bin', 'val.bin'):
        (d / f).write_bytes(open(os.path.join(corpus, 'pydocs', f), 'rb').read())
    (d / 'test.bin').write_bytes(open(os.path.join(corpus, 'pydocs', 'val.bin'), 'rb').read())
    meta['tokens']['test'], meta['bytes']['test'] = meta['tokens']['val'], meta['bytes']['val']
    meta['fingerprint'] = prepare_data.fingerprint({s: d / f'{s}.bin' for s in meta['tokens']})
    (d / 'meta.json').write_text(json.dumps(meta))
    r, = scripts(trains(tmp_path / 'data', tmp_path / 'out', '--max_iters=2'))
    assert r.returncode == 0 and 'full test split' in r.stdout
    final = metrics(tmp_path / 'out')[-1]
    assert final['event'] == 'final' and final['test_loss'] == pytest.approx(final['val_loss'])


DDP_PROBE = """
import json, os, runpy, sys, torch.distributed
from torch._dynamo.utils import counters
destroy = torch.distributed.destroy_process_group
def probe():  # at its end, each rank writes down its weights, the batch it drew last, the graphs Dynamo made, notes
    run = sys._getframe(1).f_globals  # train.py's
    json.dump(dict(weights=[p.double().sum().item() for p in run['raw_model'].parameters()], batch=run['X'].tolist(),
                   graphs=counters['stats']['unique_graphs'], notes=globals().get('notes')),
              open(os.path.join(run['out_dir'], f"rank{run['rank']}.json"), 'w'))
    destroy()
torch.distributed.destroy_process_group = probe
sys.argv[0] = 'train.py'
runpy.run_path('train.py', run_name='__main__')
"""

# rank 1: its compile fails (a backend that raises) and its validation estimates never improve (after estimate_loss's
# all-reduce, which both ranks share), while rank 0's do: with --always_save_checkpoint=False a rank-local decision
# would hang the save. notes: [estimate_loss's all-reduces, the sequences it ran through the model]
RANK1_DIFFERS = """
import functools, os, sys, torch, torch.distributed as dist, model
def failing(gm, inputs):
    raise RuntimeError('a backend that fails on rank 1 (a test)')
rank1 = os.environ['RANK'] == '1'
torch.compile = functools.partial(torch.compile, backend=failing if rank1 else 'eager')
all_reduce, forward, notes = dist.all_reduce, model.GPT.forward, [0, 0]  # the probe writes notes down
def val_differs(tensor, *a, **k):
    work = all_reduce(tensor, *a, **k)
    if sys._getframe(1).f_code.co_name == 'estimate_loss':
        notes[0] += 1
        if rank1:
            tensor += notes[0]  # each estimate worse than the last
    return work
def counting(self, idx, targets=None, cache=None):
    f = sys._getframe(1)
    while f and f.f_code.co_name != 'estimate_loss':  # (called through nn.Module's __call__)
        f = f.f_back
    notes[1] += idx.size(0) if f else 0
    return forward(self, idx, targets, cache)
dist.all_reduce, model.GPT.forward = val_differs, counting
"""

# Dynamo and AOT autograd without inductor's C++ compile; DDP's buckets small enough (1 MB) to split this model
COMPILE_IN_DDP = """
import functools, torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch._dynamo.backends.distributed import DDPOptimizer
torch.compile = functools.partial(torch.compile, backend='aot_eager')
init, split, notes = DDP.__init__, DDPOptimizer.compile_fn, []
DDP.__init__ = lambda self, *a, **k: init(self, *a, **k, bucket_cap_mb=1)
def counting(self, gm, inputs):  # Dynamo's DDP optimizer: the compiled graph's buckets, one subgraph each
    out = split(self, gm, inputs)
    notes.append(len(self.buckets))
    return out
DDPOptimizer.compile_fn = counting
"""


def torchrun(out_dir, patch, *args):
    return ('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '--no-python', sys.executable, '-c',
            patch + DDP_PROBE, '--device=cpu', f'--out_dir={out_dir}', *SMALL, *args)


@pytest.fixture(scope='module')
def ddp_runs(corpus, tmp_path_factory):
    """Two gloo ranks, 6 iterations of coupled: a run whose rank 1 fails to compile and disagrees about the val loss
    (--always_save_checkpoint=False), and the same run compiled inside DDP (aot_eager)."""
    d = tmp_path_factory.mktemp('ddp')
    flags = [f'--data_dir={corpus}', '--max_iters=6', '--eval_interval=3', '--attn=coupled', '--compile=True']
    return d, scripts(torchrun(d / 'eager', RANK1_DIFFERS, *flags, '--always_save_checkpoint=False'),
                      torchrun(d / 'compiled', COMPILE_IN_DDP, *flags))


def test_ddp_two_cpu_ranks_see_different_batches_and_end_identical(ddp_runs):
    # rank 0 decides whether to save (rank 1's estimates never improve, rank 0's do); a compile failure on rank 1
    # alone makes both ranks run eager
    d, (r, compiled) = ddp_runs
    tmp_path = d / 'eager'
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count('warning: torch.compile failed') == 1 and 'eager, 2' in r.stdout
    assert [m['compiled'] for m in metrics(tmp_path) if m['event'] == 'start'] == [False]
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == 6  # rank 0's val loss improved
    ranks = [json.load(open(tmp_path / f'rank{i}.json')) for i in range(2)]
    assert ranks[0]['weights'] == ranks[1]['weights'] and ranks[0]['batch'] != ranks[1]['batch']
    # 3 evals, 2 splits: one all-reduce each, and each rank 4 of the 2 x 4 sequences (--eval_iters=2, batch 4)
    assert ranks[0]['notes'] == ranks[1]['notes'] == [3 * 2, 3 * 2 * 4]
    ranked = run('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', '--device=cpu',
                 f'--out_dir={tmp_path}', '--eval_only=True')  # evaluation alone, under torchrun
    assert ranked.returncode == 0, ranked.stderr[-2000:]
    assert '2 process(es)' in r.stdout
    single, resumed = scripts(('train.py', f'--out_dir={tmp_path}', '--eval_only=True'),
                              ('train.py', f'--out_dir={tmp_path}', '--init_from=resume', '--max_iters=8',
                               '--compile=False'))
    full = lambda out: float(re.search(r'full val split: loss ([\d.]+)', out).group(1))
    assert full(r.stdout) == full(ranked.stdout) == pytest.approx(full(single.stdout), abs=2e-4)  # shared windows
    # resumed as one process: the tokens count what was trained, 6 x 2 ranks, then 2 x 1
    assert resumed.returncode == 0, resumed.stderr
    assert 'note: the checkpoint was trained by 2 process(es), this run has 1: its batches are drawn anew' \
        in resumed.stdout  # said, not silent
    assert [m for m in metrics(tmp_path) if m['event'] == 'final'][-1]['tokens'] == (6 * 2 + 2) * 4 * 32


def test_ddp_compiles_inside_ddp_split_at_its_buckets_and_trains_as_eager(ddp_runs):
    # the first compiled call runs inside DDP's forward, so Dynamo's DDP optimizer splits the graph at DDP's gradient
    # buckets (their all-reduce overlaps the backward), and the one graph is all: a trial step compiled before DDP
    # wrapped the model made a graph without DDP, which torch 2.13 then compiled a second time inside it
    d, (eager, r) = ddp_runs
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'torch.compile failed' not in r.stdout and 'compiled, 2 process(es)' in r.stdout
    assert [m['compiled'] for m in metrics(d / 'compiled') if m['event'] == 'start'] == [True]
    ranks = [json.load(open(d / 'compiled' / f'rank{i}.json')) for i in range(2)]
    assert [(r['graphs'], r['notes']) for r in ranks] == [(1, [2])] * 2  # one graph, split into two buckets
    assert ranks[0]['weights'] == ranks[1]['weights']
    want = json.load(open(d / 'eager' / 'rank0.json'))['weights']
    assert ranks[0]['weights'] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_ddp_estimates_are_the_one_process_estimates_of_the_same_set(ddp_runs, tmp_path):
    # the evaluation set is eval_iters x batch_size sequences whatever the world size: the 2-rank run's last estimates
    # (each rank half of the set, see the notes above) and one process's, resumed from its checkpoint at that step
    d, (eager, r) = ddp_runs
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(d / 'compiled', tmp_path / 'one')
    one = run('train.py', f'--out_dir={tmp_path / "one"}', '--init_from=resume', '--max_iters=6', '--compile=False')
    assert one.returncode == 0 and '1 process(es)' in one.stdout, one.stderr[-2000:]
    two, single = ([m for m in metrics(p) if m['event'] == 'eval'][-1] for p in (d / 'compiled', tmp_path / 'one'))
    assert two['iter'] == single['iter'] == 6 and two is not single
    for k in ('train_loss', 'val_loss'):
        assert two[k] == pytest.approx(single[k], rel=1e-6, abs=0), k  # float rounding: shares summed


def test_compile_works_on_cpu(corpus, tmp_path):
    r = train(corpus, tmp_path, '--compile=True', '--max_iters=3', '--eval_interval=3', '--n_layer=1',
              '--attn=coupled', '--dtype=bfloat16', timeout=600)  # as the GPU recipe: bf16 autocast, compiled
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'compiling' in r.stdout and 'torch.compile failed' not in r.stdout and 'bfloat16, compiled' in r.stdout
    assert metrics(tmp_path)[0]['compiled'] is True
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert not any(k.startswith('_orig_mod.') for k in ckpt['model'])


# ---------------------------------------------------------------------------------------------------------------
# the loop on a GPU's terms: no host-device sync between log steps, non-finite losses caught before any save, MFU

def patched_train(corpus, out_dir, patch, *args, popen=False):
    """train.py run as a user runs it, with `patch` (python code) executed first, e.g. to count syncs or make the
    checkpoint write slow; popen: started, not waited for."""
    return (start if popen else run)(*trains(corpus, out_dir, *args), patch=patch)


COUNT_SYNCS = """
import json, sys, torch
calls = []
def counting(name, orig):
    def f(self, *a, **k):
        frame = sys._getframe(1)  # called from train.py itself (its loop, its functions), not from torch
        if frame.f_code.co_filename.endswith('train.py') and frame.f_code.co_name != 'get_batch':
            calls.append([frame.f_globals.get('iter_num'), frame.f_code.co_name, name])
        return orig(self, *a, **k)
    return f
for name in ('item', 'tolist', 'cpu', 'numpy', '__bool__', '__float__', '__int__', '__format__'):
    setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
import atexit
atexit.register(lambda: json.dump(calls, open(SYNCS, 'w')))
"""


def train_functions(*names, **run):
    """train.py's own functions `names`, defined over the globals `run` (what train.py's set-up would have made)."""
    tree = ast.parse(open(os.path.join(HERE, 'train.py')).read())
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert [d.name for d in defs] == list(names)
    exec(compile(ast.Module(defs, type_ignores=[]), 'train.py', 'exec'), run)
    return run


def test_estimate_loss_is_one_process_s_batch_means_exactly_and_its_ranks_shares_sum_to_them(corpus):
    # one process: the mean of eval_iters batch means, as before the estimates were sharded (below, bit for bit);
    # W ranks: the same eval_iters x batch_size sequences split by sequence (16 ranks > 15 sequences: some get none),
    # one all-reduce of the (eval_iters,) batch means per split, the same estimate to float rounding
    splits = {s: os.path.join(corpus, 'pydocs', f'{s}.bin') for s in ('train', 'val')}
    net = GPT(tiny('coupled', vocab_size=257, block_size=16)).eval()
    E, B, T = 5, 3, 16

    def old(split):  # estimate_loss and get_batch as they were, one whole batch at a time
        gen, losses = torch.Generator().manual_seed(10_000), torch.zeros(E)
        for k in range(E):
            data = np.memmap(splits[split], dtype=np.uint16, mode='r')
            ix = torch.randint(len(data) - T - 1, (B,), generator=gen)
            x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
            losses[k] = net(x, y)[1].item()
        return losses.mean().item()

    class Dist:  # each rank's tensor as it goes into the all-reduce; the sum is taken below
        def all_reduce(self, t):
            shares.append(t.clone())

    def estimate(rank, world_size):
        run = train_functions('to_device', 'get_batch', 'estimate_loss', torch=torch, np=np, dist=Dist(),
                              nullcontext=contextlib.nullcontext, splits=splits, block_size=T, batch_size=B,
                              eval_iters=E, device='cpu', device_type='cpu', raw_model=net,
                              autocast=contextlib.nullcontext(), ddp=world_size > 1, rank=rank,
                              world_size=world_size)
        return run['estimate_loss']()

    shares = []
    one = estimate(0, 1)
    assert one == {'train': old('train'), 'val': old('val')} and not shares  # exact; no all-reduce
    for W in (2, 4, 16):
        shares = []
        for rank in range(W):
            estimate(rank, W)
        assert len(shares) == 2 * W  # one all-reduce per split and rank
        for i, split in enumerate(('train', 'val')):
            mine = torch.stack(shares[i::2])  # (W, E): each rank's shares of the batch means
            assert mine.sum(0).mean().item() == pytest.approx(one[split], rel=1e-6, abs=0), (W, split)
        if W == 16:  # 15 sequences: rank 0's share is empty (it draws the batches, builds none, reduces zeros)
            assert not shares[0].any() and shares[-1].count_nonzero().item() == 1


def test_the_loop_syncs_with_the_device_only_at_log_steps_and_evals(corpus, tmp_path):
    # every .item()/.cpu()/bool(tensor)... that train.py makes, with the iteration it was made at: between log steps
    # (every 10) and evals (every 15) there must be none, so a GPU never waits for the host
    patch = COUNT_SYNCS.replace('SYNCS', repr(str(tmp_path / 'syncs.json')))
    r = patched_train(corpus, tmp_path / 'out', patch, '--max_iters=30', '--log_interval=10', '--eval_interval=15')
    assert r.returncode == 0, r.stderr[-2000:]
    calls = json.load(open(tmp_path / 'syncs.json'))
    in_loop = {it for it, fn, name in calls if fn in ('<module>', 'check_losses')}
    assert in_loop and in_loop <= {0, 1, 10, 15, 20, 30}, sorted(in_loop)  # evals 0, 15, 30; logs 1, 10, 20, 30
    assert {10, 20} <= in_loop  # the log steps do read the loss (so this test would see a sync per iteration)


INJECT_NAN = """
import model, sys
forward, at = model.GPT.forward, [AT]
def nan_at(self, idx, targets=None, cache=None):
    logits, loss = forward(self, idx, targets, cache)
    f = sys._getframe(1)
    while f and not f.f_code.co_filename.endswith('train.py'):
        f = f.f_back
    if self.training and f and f.f_code.co_name == '<module>' and f.f_globals['iter_num'] in at:
        at.remove(f.f_globals['iter_num'])
        loss = loss * float('nan')  # the training step of that iteration, once
    return logits, loss
model.GPT.forward = nan_at
model.peak_flops = lambda device: 1e12  # MFU as on a GPU whose peak is known
"""


@pytest.fixture(scope='module')
def nan_runs(corpus, tmp_path_factory):
    """NaNs at iteration 12 (logs every 5) and 18 (every 7: an interval that ends at an eval) of runs that save
    every 10, each then resumed; a finished run resumed to train longer, a NaN at iteration 6."""
    d = tmp_path_factory.mktemp('nan')
    nan = ['--max_iters=40', '--eval_interval=10', '--attn=coupled']
    calls = [(12, trains(corpus, d / 'a', *nan, '--log_interval=5')),
             (None, trains(corpus, d / 'a', '--init_from=resume')),
             (18, trains(corpus, d / 'b', *nan, '--log_interval=7')),
             (None, trains(corpus, d / 'b', '--init_from=resume')),
             (None, trains(corpus, d / 'finished', '--max_iters=4', '--eval_interval=2', '--log_interval=2')),
             (6, trains(corpus, d / 'finished', '--init_from=resume', '--max_iters=12'))]
    chain = lambda pair: [run(*call, patch=INJECT_NAN.replace('AT', repr(at))) for at, call in pair]  # noqa: E731
    with ThreadPoolExecutor(2) as pool:  # the three folders side by side, each run and then its resume
        return d, [r for pair in pool.map(chain, (calls[:2], calls[2:4], calls[4:])) for r in pair]


@pytest.mark.parametrize('run, at', [('a', 12), ('b', 18)])
def test_a_nan_between_checkpoints_stops_the_run_and_the_last_good_checkpoint_resumes(nan_runs, run, at):
    d, rs = nan_runs
    r, resumed = rs[:2] if run == 'a' else rs[2:4]
    # the step taken at iter_num 12 is the one the log prints as "iter 13": the NaN is named as the log names it
    assert r.returncode == 3 and f'not finite at iteration {at + 1} ' in r.stderr, r.stderr[-2000:]
    assert 'the last checkpoint is at iteration 10:' in r.stderr and one_line_error(r, '--init_from=resume')
    assert resumed.returncode == 0 and 'at iteration 10' in resumed.stdout, resumed.stderr
    ckpt = torch.load(d / run / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 40 and all(torch.isfinite(v).all() for v in ckpt['model'].values())
    log = metrics(d / run)
    assert math.isfinite([m for m in log if m['event'] == 'final'][-1]['val_loss'])
    assert [m['iter'] for m in log if m['event'] == 'diverged'] == [at + 1]  # logged, for results/report.py


def test_G3_the_report_counts_a_diverged_run_failed_until_a_resume_trains_past_it(nan_runs, capsys):
    d, rs = nan_runs
    first = [m for m in metrics(d / 'a') if m['event'] in ('diverged', 'final')][0]
    assert first['event'] == 'diverged'  # the log as it stood when the run stopped: a diverged run
    lines = open(d / 'a' / 'metrics.jsonl').read().splitlines()
    cut = next(i for i, line in enumerate(lines) if '"diverged"' in line) + 1
    os.makedirs(d / 'stopped' / 'a-s1')
    (d / 'stopped' / 'a-s1' / 'metrics.jsonl').write_text('\n'.join(lines[:cut]) + '\n')
    code, out, err = tabulate(capsys, d / 'stopped')
    assert code == 0 and report_rows(out)['a'][2:4] == ['1', 'inf (1 of 1 failed)'], (out, err)
    code, out, err = tabulate(capsys, d / 'a')  # resumed from 10, it finished
    final = [m for m in metrics(d / 'a') if m['event'] == 'final'][0]['val_ppl']
    assert code == 0 and report_rows(out)['a'][2:4] == ['1', f"{final:.3f}"], (out, err)


def test_a_finished_run_resumed_to_train_longer_keeps_its_result_when_the_extension_stops(nan_runs, capsys):
    d, rs = nan_runs
    first, extension = rs[4:]
    assert first.returncode == 0 and extension.returncode == 3, extension.stderr
    assert one_line_error(extension, 'the last checkpoint is at iteration 6:')  # saved at 6 (eval), NaN at 6
    finals = [m for m in metrics(d / 'finished') if m['event'] == 'final']
    assert len(finals) == 1 and finals[0]['iter'] == 4  # the log is appended to, never rewritten
    code, out, err = tabulate(capsys, d / 'finished')
    assert code == 0 and f"| {finals[0]['val_ppl']:.3f} |" in out, (out, err)  # the report shows that result


def test_mfu_is_in_the_log_line_where_the_peak_is_known(nan_runs):
    # on CUDA the peak comes from model.GPU_PEAK_FLOPS by the device's name; here a mocked peak stands in for it
    d, rs = nan_runs
    assert re.search(r'iter 4/4 \| .* \| mfu \d+\.\d%', rs[4].stdout), rs[4].stdout
    record = [m for m in metrics(d / 'finished') if m['event'] == 'train'][-1]
    want = flops_per_token(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=32, vocab_size=257), 32) * 4 * 32
    assert record['mfu'] == pytest.approx(want / (record['ms'] / 1000) / 1e12, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# a GPU's facts, checked on a CPU: dtype=auto, diff's SDPA calls, compiled graphs, bf16

@pytest.mark.parametrize('native, emulated, want', [(True, True, 'bfloat16'), (False, True, 'float16'),
                                                    (False, False, 'float16')])
def test_dtype_auto_is_bf16_only_where_the_gpu_computes_it_natively(monkeypatch, native, emulated, want):
    # A100/H100: native bf16; T4/V100: emulated only, so fp16 (train.py's GradScaler is on for fp16)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported',
                        lambda including_emulation=True: native or (emulated and including_emulation))
    assert M.autocast_dtype('cuda:0') == want and M.autocast_dtype('cpu') == 'float32'


@pytest.mark.parametrize('attn', ['diff', 'diff+coupled'])
def test_diff_attention_with_v_split_to_the_head_size_is_the_same_attention(attn, monkeypatch):
    # split_v: every SDPA call sees q, k, v of one head size (flash attention's condition); outputs, gradients and
    # the KV cache's logits as with one call per sub-head at v's full width. Neither copies v per sub-head
    model, idx = build(attn, pos='rope'), idx_batch(T=12)
    randomize_qk(model)
    sdpa, shapes = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, 'scaled_dot_product_attention', lambda q, k, v, **kw: (
        shapes.append((q.shape, v.shape)), sdpa(q, k, v, **kw))[1])
    got = {}
    for split in (False, True):
        monkeypatch.setattr(M.CausalSelfAttention, 'split_v', split)
        shapes.clear()
        model.zero_grad()
        logits, loss = model(idx, targets=idx)
        loss.backward()
        cache = KVCache(model.config.n_layer)
        cached = torch.cat([model(idx[:, :5], cache=cache)[0]] + [model(idx[:, t:t + 1], cache=cache)[0]
                                                                 for t in range(5, 12)], dim=1)
        got[split] = logits, [p.grad for p in model.parameters()], cached
        hs, nh = model.config.n_embd // model.config.n_head, model.config.n_head
        assert all(q[1] == v[1] == nh // 2 and v[-1] == (hs if split else 2 * hs) for q, v in shapes)
    (a, ga, ca), (b, gb, cb) = got[False], got[True]
    assert torch.allclose(a, b, atol=1e-6, rtol=0) and torch.allclose(ca, cb, atol=1e-6, rtol=0)
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-5) for x, y in zip(ga, gb))
    assert torch.allclose(ca, a.detach(), atol=1e-5)


def test_diff_under_bf16_autocast_warns_nothing():
    # diff's per-head RMSNorm runs in float32 (as autocast runs LayerNorm): no dtype mismatch with its gain, so no
    # warning and the fused kernel
    model, idx = build('diff+coupled'), idx_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with torch.autocast('cpu', dtype=torch.bfloat16):
            loss = model(idx, targets=idx)[1]
        loss.backward()
    assert not [str(w.message) for w in caught] and torch.isfinite(loss)


def test_a_compiled_training_step_has_no_graph_break_and_no_recompile():
    # every --attn, as train.py compiles it (the whole model, bf16 autocast on a GPU), three steps: one graph, made
    # at the first. Dynamo's eager backend: the graph is traced as on a GPU, without inductor's compile
    from torch._dynamo.utils import counters
    idx = idx_batch()
    try:
        for attn in attn_names():
            torch._dynamo.reset()
            counters.clear()
            model = build(attn, n_layer=1, pos='rope' if 'coupled' in attn else 'learned')
            step, graphs = torch.compile(model, backend='eager'), []
            for _ in range(3):
                with torch.autocast('cpu', dtype=torch.bfloat16):
                    loss = step(idx, targets=idx)[1]
                loss.backward()
                graphs.append(counters['stats']['unique_graphs'])
            assert not counters['graph_break'] and graphs == [1, 1, 1], (attn, dict(counters['graph_break']), graphs)
    finally:
        torch._dynamo.reset()


SHIPPED = [a for a in ('coupled', 'euler', 'symplectic-euler', 'euler-mlp', 'coupled-mlp', 'uncoupled', 'invertible')
           if a in TRANSFORMS]  # the maps this repository ships: their dtype is our speed, not a promise of an entry


@pytest.mark.parametrize('attn', SHIPPED)
def test_under_bf16_autocast_q_and_k_leave_the_qk_map_in_bf16(attn):
    # dt and the biases are cast to q's dtype: the elementwise work and q', k' stay bf16 (half the memory traffic)
    qk = qk_maps(build(attn))[0]
    q, k = (torch.randn(2, 4, 16, 8).bfloat16() for _ in range(2))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = qk(q, k)
    assert [x.dtype for x in out] == [torch.bfloat16] * 2, attn
    assert [x.dtype for x in qk(q.float(), k.float())] == [torch.float32] * 2  # no autocast: float32, as before


def test_the_qk_map_in_bf16_stays_within_bf16s_rounding_of_float32():
    # coupled at 60m's head shape, on bf16 q, k as autocast's c_attn makes them, against float64. bf16 keeps 8
    # significant bits (rounding: up to 0.4%): the output (q', k') within 1% of the reference's; the map's move
    # (q' - q, k' - k: ~10% of |q|, |k|), whose sum with a bf16 k is rounded again, within 5%. bench.py --gpu_check
    # prints both on CUDA
    out, move = bench.qk_bf16_error('cpu')
    assert 0 < out < 0.01 and 0 < move < 0.05, (out, move)


# ---------------------------------------------------------------------------------------------------------------
# bench.py: records, not timings (timings are never asserted)

def bench_main(capsys, monkeypatch, *args):
    """python bench.py ARGS in this process (a subprocess would pay torch's import): a CompletedProcess."""
    monkeypatch.setattr(sys, 'argv', ['bench.py', *args])
    try:
        bench.main()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit('error: ...'): Python prints the line and exits with 1
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    out = capsys.readouterr()
    return subprocess.CompletedProcess('bench.py', code, out.out, out.err)


def failing_backend(gm, inputs):
    raise RuntimeError('no compiler here (a test)')


@pytest.mark.parametrize('backend', ['eager', failing_backend])
def test_gpu_check_runs_at_a_reduced_shape_on_cpu(tmp_path, capsys, monkeypatch, backend):
    # as on a GPU (CUDA's presence patched), at a tiny shape on the CPU; Dynamo with its cheapest backend, or with
    # one that fails: the check goes on eager and every record says whether compile ran
    available = torch.cuda.is_available  # True for bench.py's own question only (Dynamo asks it too)
    asked_by_bench = lambda: sys._getframe(2).f_code is bench.main.__code__
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: asked_by_bench() or available())
    real = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda model: real(model, backend=backend))
    out = tmp_path / 'check.jsonl'
    r = bench_main(
        capsys, monkeypatch, '--gpu_check', '--device=cpu', '--dtype=bfloat16', '--preset=tiny', '--batch_size=2',
        '--block_size=16', '--vocab_size=64', '--iters=1', '--warmup=0', f'--json_out={out}')
    assert r.returncode == 0, r.stderr[-2000:]
    works = backend == 'eager'
    failed = [f'torch.compile failed for {v}' in r.stdout for v in ('standard', 'coupled')]
    assert failed == [not works] * 2
    assert re.search(r'q/k map \(coupled\) in bf16 against float64: output \d+\.\d+%, its move \d+\.\d+%', r.stdout)
    # (a ratio of one untimed-warm-up step each: any size, 12.345 as well; a timing is never asserted)
    assert re.search(r'coupled --qk_steps=7 / standard, eager: \d+\.\d{3}\n', r.stdout), r.stdout[-1500:]
    assert 'sync debug mode: skipped (CUDA only)' in r.stdout  # a CPU: no CUDA sync check
    assert re.search(r'coupled / standard, eager: \d+\.\d{3}\n', r.stdout), r.stdout[-1500:]
    assert re.search(r'coupled / standard, compiled: \d+\.\d{3}\n', r.stdout) or not works
    assert ('compile did not run' in r.stdout) != works and 'diff, eager: v at 2hs' in r.stdout
    records = [json.loads(line) for line in open(out)]
    assert sorted(rec['attn'] for rec in records) == ['coupled', 'coupled', 'coupled (qk_steps=7)',
                                                      'diff (split_v=False)', 'diff (split_v=True)', 'standard',
                                                      'standard']
    assert sorted(rec['compiled'] for rec in records) == [False] * (7 - 2 * works) + [True] * (2 * works)
    ratio = {rec['attn']: rec['flop_model_ratio'] for rec in records}  # 7 steps priced as 7 (14 forces a layer)
    assert ratio['coupled (qk_steps=7)'] > ratio['coupled'] > 1
    assert all(rec['mfu'] is None for rec in records)  # no peak known for a CPU
    assert M.CausalSelfAttention.split_v is None  # restored


def test_gpu_check_without_cuda_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    r = bench_main(capsys, monkeypatch, '--gpu_check')
    assert one_line_error(r, '--gpu_check needs a CUDA GPU') and r.stdout == ''


def test_bench_writes_one_record_per_variant_and_mode(tmp_path, capsys, monkeypatch):
    out = tmp_path / 'bench.jsonl'
    r = bench_main(
        capsys, monkeypatch, '--preset=tiny', '--attn=coupled,diff+coupled', '--vocab_size=64', '--batch_size=2',
        '--block_size=16', '--new_tokens=4', '--iters=1', '--warmup=0', f'--json_out={out}')
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(line) for line in open(out)]
    modes = ('train', 'forward', 'generate', 'generate-nocache')
    assert {(rec['attn'], rec['mode']) for rec in records} == {(a, m) for a in ('standard', 'coupled', 'diff+coupled')
                                                                for m in modes}
    for rec in records:
        assert rec['ms_per_iter'] > 0 and rec['tokens_per_s'] > 0
        assert (rec['ratio_vs_standard'] == 1.0) == (rec['attn'] == 'standard')
    flop = {rec['attn']: rec['flop_model_ratio'] for rec in records if rec['mode'] == 'train'}
    assert flop['standard'] == 1.0 and 1.0 < flop['coupled'] < flop['diff+coupled'] < 1.05
    assert 'KV cache generates 4 tokens' in r.stdout


@pytest.mark.parametrize('args, words', [
    (['--attn=hamiltonian'], 'hamiltonian'), (['--mode=backward'], 'backward'), (['--preset=huge'], 'preset'),
    (['--device=tpu'], '--device=tpu is unknown, or not available here'), (['--plan', '--world_size=3'],
                                                                            '--world_size=3'),
    *([] if torch.backends.mps.is_available() else [(['--device=mps'], '--device=mps is unknown, or not available')]),
])
def test_bench_bad_flags_give_one_clear_line(args, words, capsys, monkeypatch):
    assert one_line_error(bench_main(capsys, monkeypatch, *args), words)


# ---------------------------------------------------------------------------------------------------------------
# the README's one-GPU recipe: every command's code path, on CPU, at a reduced shape

def gpu_recipe():
    """The README's recipe: the command R and each run's (name, flags after $R)."""
    ladder = readme_section('The ladder')
    return re.search(r'^R="(.*)"$', ladder, re.M).group(1), re.findall(r'^\| (\S+) \| `\$R (.*?)` \|', ladder, re.M)


def test_readme_gpu_recipe_is_what_bench_plan_prints(capsys, monkeypatch):
    r = bench_main(capsys, monkeypatch, '--plan')
    assert r.returncode == 0, r.stderr
    ladder = readme_section('The ladder')
    assert all(line in ladder for line in r.stdout.splitlines())  # the README shows bench.py's recipe, as printed
    names = [name for name, flags in gpu_recipe()[1]]
    assert names == ['standard', 'coupled', 'euler', 'uncoupled', 'coupled-steps7', 'invertible', 'diff',
                     'diff+coupled', 'standard-2.4x']
    # 8 GPUs: the README's launcher and per-rank flags are bench.py --plan --world_size=8's, and both recipes keep
    # 65,536 tokens per step and 1.31B per run (batch flags are per rank)
    eight = bench_main(capsys, monkeypatch, '--plan', '--world_size=8')
    assert eight.returncode == 0 and '65,536 tokens per step' in eight.stdout
    flags = lambda command: dict(a[2:].split('=', 1) for a in shlex.split(command) if a[:2] == '--' and '=' in a)
    one, eight = gpu_recipe()[0], re.search(r'^R="(.*)"$', eight.stdout, re.M).group(1)
    step3 = ' '.join(ladder[ladder.index('**3. Eight GPUs'):].split())
    launch, _, rest = eight.partition(' --preset')
    per_rank = {k: v for k, v in flags('--preset' + rest).items() if flags(one).get(k) != v}
    assert f'`{launch}`' in step3 and f"`{' '.join(f'--{k}={v}' for k, v in per_rank.items())}`" in step3
    assert flags(one) | per_rank == flags('--preset' + rest)  # the rest as on one GPU
    for command in (one, eight):
        f = flags(command)
        step = int(f.get('nproc_per_node', 1)) * int(f['batch_size']) * int(f['gradient_accumulation_steps']) * int(
            f['block_size'])
        assert step == 65_536 and step * int(f['max_iters']) == 1_310_720_000, command


def test_plan_adds_evaluation_and_compile_to_training_and_says_they_are_estimates(capsys, monkeypatch):
    # training splits over the ranks; the estimates' sequences split by sequence (sharded evaluation); rank 0's
    # diagnostics and the compile do not: on 8 GPUs they are a larger part of the time
    cfg, T = GPTConfig(**PRESETS['60m']), 512
    one, eight = (bench.plan_minutes(cfg, T, 1.31e9, 21, ws, 989e12) for ws in (1, 8))
    assert eight['train'] == pytest.approx(one['train'] / 8) and one['compile'] == eight['compile'] > 0
    forward = flops_per_token(cfg, T) / 3 / (bench.UTILISATION * 989e12) / 60  # minutes a token
    assert one['eval'] == pytest.approx(21 * forward * (2 * 40 * 32 * T + bench.DIAG_TOKENS))
    assert eight['eval'] == pytest.approx(21 * forward * (2 * 40 * 32 * T / 8 + bench.DIAG_TOKENS))
    r = bench_main(capsys, monkeypatch, '--plan', '--world_size=8')
    row = re.search(r'^\| standard \| .*\| ([\d.]+) (min|h) \| [\d.]+ (?:min|h) \|$', r.stdout, re.M)
    assert r.returncode == 0 and float(row.group(1)) == round(sum(bench.plan_minutes(
        cfg, T, 1_310_720_000, 21, 8, bench.GPU_PEAK_FLOPS['NVIDIA H100 80GB HBM3']).values())), r.stdout
    assert 'Each time is an estimate' in r.stdout and 'Compilation' in r.stdout and '21 evaluations' in r.stdout


@pytest.fixture(scope='module')
def wikitext103(tmp_path_factory):
    """WikiText-103 as the recipe reads it: a zip with the archive's layout, through prepare_data.py's --input."""
    if not os.environ.get('TIKTOKEN_CACHE_DIR'):
        pytest.skip('TIKTOKEN_CACHE_DIR is not set: the gpt2 tokenizer would need the network')
    import zipfile
    d = tmp_path_factory.mktemp('wikitext103')
    article = lambda i: (f" = Article {i} = \n\n The {i} th query evolves with its key under a learned potential ; "
                         f"the step size is {i % 7} tenths . \n\n = = History = = \n\n Founded in {1900 + i} . \n")
    with zipfile.ZipFile(d / 'wikitext-103-raw-v1.zip', 'w') as z:
        for split, n in (('train', 300), ('valid', 3), ('test', 3)):  # bf16 on a CPU is slow
            z.writestr(f'wikitext-103-raw/wiki.{split}.raw', ''.join(article(i) for i in range(n)))
    r = run('prepare_data.py', 'wikitext103', f'--input={d / "wikitext-103-raw-v1.zip"}', f'--data_dir={d / "data"}')
    assert r.returncode == 0, r.stderr
    return d / 'data'


def test_sample_prints_text_from_a_bytes_and_a_gpt2_checkpoint(corpus, wikitext103, tmp_path):
    # bytes: the quick start's kind of run; GPT-2 tokens, at the end of a run and from its checkpoint
    b, g = tmp_path / 'bytes', tmp_path / 'gpt2'
    sample = lambda out, *a: ('train.py', f'--out_dir={out}', *a)
    trained, r, again, other, gtrained, gr = scripts(
        trains(corpus, b, '--max_iters=30', '--learning_rate=3e-3'),
        sample(b, '--sample=def ', '--sample_tokens=40'), sample(b, '--sample=def ', '--sample_tokens=40'),
        sample(b, '--sample=def ', '--sample_tokens=40', '--seed=7'),
        ('train.py', *REDUCED, f'--data_dir={wikitext103}', '--dataset=wikitext103', f'--out_dir={g}',
         '--sample_tokens=12'),
        sample(g, '--sample=The query', '--sample_tokens=12'))
    assert trained.returncode == 0 and r.returncode == 0, trained.stderr + r.stderr
    head, text = r.stdout.split("sample (seed 1337, 40 tokens after 'def '):\n")
    assert text.startswith('def ') and len(text.encode('utf-8', 'surrogateescape')) >= 40
    assert again.stdout == r.stdout and other.stdout != r.stdout  # the seed decides
    assert 'resuming' not in r.stdout and not (b / 'ckpt.pt.tmp').exists()
    assert gtrained.returncode == 0 and "sample (seed 1337, 12 tokens after ''):" in gtrained.stdout, gtrained.stderr
    assert gr.returncode == 0, gr.stderr
    text = gr.stdout.split("tokens after 'The query'):\n")[1]
    import tiktoken
    assert text.startswith('The query') and len(tiktoken.get_encoding('gpt2').encode(text)) >= 12


REDUCED = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=1',
           '--gradient_accumulation_steps=2', '--max_iters=2', '--eval_interval=2', '--eval_iters=1',
           '--warmup_iters=1', '--compile=False', '--device=cpu', '--sample_tokens=0']  # compile: its own test


def test_every_gpu_recipe_command_runs_at_a_reduced_shape_and_tabulates(wikitext103, tmp_path, capsys):
    prefix, rows = gpu_recipe()
    command = lambda flags: shlex.split(prefix)[2:] + shlex.split(flags) + REDUCED + [f'--data_dir={wikitext103}']
    with ThreadPoolExecutor(2) as pool:  # two processes side by side, one thread each, half the runs in each
        halves = list(pool.map(lambda half: scripts(*[(os.path.join(HERE, 'train.py'), *command(flags))
                                                      for name, flags in half], cwd=tmp_path), (rows[::2], rows[1::2])))
    results = [None] * len(rows)
    results[::2], results[1::2] = halves
    for (name, flags), r in zip(rows, results):
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert 'bfloat16' in r.stdout and 'full val split' in r.stdout and 'full test split' in r.stdout, name
        assert 'Warning' not in r.stderr, (name, r.stderr[-2000:])  # e.g. diff's norm fed bf16 against a float32 gain
        final = metrics(tmp_path / 'runs' / '60m' / name)[-1]
        assert final['event'] == 'final' and all(math.isfinite(final[k]) for k in ('val_ppl', 'test_ppl', 'val_bpb'))
    code, out, err = tabulate(capsys, tmp_path / 'runs' / '60m')
    assert code == 0, err
    assert all(f'| wikitext103 | {name} | 1 |' in out for name, flags in rows), out


# ---------------------------------------------------------------------------------------------------------------
# the report of train.py runs (results/report.py; its tables: results/test_results.py)

def test_the_report_tabulates_train_py_runs_and_skips_a_line_cut_short(corpus, tmp_path, capsys):
    for name, attn in (('out-standard', 'standard'), ('out-coupled', 'coupled')):
        assert train(corpus, tmp_path / name, '--max_iters=2', '--eval_interval=1', f'--attn={attn}').returncode == 0
    with open(tmp_path / 'out-coupled' / 'metrics.jsonl', 'a') as f:
        f.write('{"event": "train", "it')  # a run killed while writing
    code, out, err = tabulate(capsys, tmp_path / 'out-standard', tmp_path / 'out-coupled')
    assert code == 0 and 'out-coupled/metrics.jsonl:' in err and 'skipped' in err, err
    rows = [line for line in out.split('\n\n')[0].splitlines() if line.startswith('| ') and 'variant' not in line]
    assert len(rows) == 2 and any('| coupled |' in row for row in rows) and any('| standard |' in row for row in rows)
    assert '\nAttention at the final eval' in out  # train.py's attention diagnostics, per layer
    for name in ('out-standard', 'out-coupled'):
        att = [m for m in report.read_log(tmp_path / name / 'metrics.jsonl') if m['event'] == 'eval'][-1]['attn']
        assert len(att) == 2 and all(set(layer) == {'entropy', 'sink', 'gap'} for layer in att), att
    assert report.read_log(tmp_path / 'out-coupled' / 'metrics.jsonl')[0]['vocab_size'] == 257  # (failed: by it)


# ---------------------------------------------------------------------------------------------------------------
# the repository: what train.py imports, what the README and results/ point to

def readme_section(title, text=None):
    text = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read() if text is None else text
    return text.split(f'\n## {title}\n')[1].split('\n## ')[0]


def test_train_py_imports_only_model_and_prepare_data_from_the_repository():
    imports = re.findall(r'^(?:from|import) (\w+)', open(os.path.join(HERE, 'train.py')).read(), re.M)
    assert {'model', 'prepare_data'} <= set(imports) and not {'bench', 'test_model'} & set(imports)


def test_readme_and_results_have_no_placeholder_left_and_their_pictures_exist():
    pages = ['README.md'] + [os.path.join('results', f) for f in os.listdir(os.path.join(HERE, 'results'))
                             if f.endswith('.md')]
    drawn = []
    for page in pages:
        text = open(os.path.join(HERE, page), encoding='utf-8').read()
        assert '\u27e8' not in text and '{' + 'EX' not in text, page  # no placeholder left where a number belongs
        pictures = [os.path.join(os.path.dirname(page), p) for p in re.findall(r'!\[[^]]*\]\(([^)]+\.png)\)', text)]
        assert all(os.path.exists(os.path.join(HERE, p)) for p in pictures), (page, pictures)
        drawn += pictures
    assert {'results/.assets/curves.png', 'results/.assets/stability.png', 'results/.assets/long.png'} <= set(drawn)


def test_nothing_a_user_reads_points_outside_the_repository():  # a clone has no folder beside it
    names = ['README.md', 'model.py', 'train.py', 'prepare_data.py', 'bench.py', 'test_model.py']
    for folder in ('exercises', 'results'):
        names += [os.path.join(folder, f) for f in os.listdir(os.path.join(HERE, folder)) if '.' in f[1:]
                  and f.rsplit('.', 1)[1] in ('py', 'md', 'sh')]
    for name in names:
        text = open(os.path.join(HERE, name), encoding='utf-8').read()
        assert '..' + '/shared' not in text and '/work' + '/shared' not in text, name
