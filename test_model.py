"""
The spec, in pytest. First the mathematics each attention variant promises (model.py): dt = 0 is standard
attention, leapfrog is reversible and keeps volume, the closed-form force is the gradient of V, no position sees
the future, the KV cache equals the full forward pass, the parameter budgets. Then the scripts, run the way a
user runs them: prepare_data.py, train.py (resume, evaluation, bad input, DDP, compile), bench.py, and the
README's classroom exercises.
Run: python -m pytest -q
"""
import ast
import contextlib
import dataclasses
import gzip
import hashlib
import http.server
import io
import itertools
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bench
import prepare_data
import model as M
from model import (INTEGRATORS, PRESETS, QK_TRANSFORMS, GPT, GPTConfig, Hamiltonian, Integrator, Invertible, KVCache,
                   QKTransform, attn_names, flops_per_token, qk_diagnostics)

ATTN = attn_names()
TRANSFORMS = [a for a in ATTN if a not in ('standard', 'diff')]  # variants with a q/k map


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
    if attn.endswith(('coupled', 'euler', 'uncoupled')):
        assert any(n.endswith('.dt') for n, _ in named)  # the learned step size is among them


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


@pytest.mark.parametrize('attn', TRANSFORMS)
def test_zero_step_or_identity_is_exactly_the_base_attention(attn):
    base = 'diff' if attn.startswith('diff') else 'standard'
    ref = build(base)
    model = build(attn, seed=1)
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all('.qk.' in n for n in missing)
    randomize_qk(model)  # arbitrary dynamics weights ...
    with torch.no_grad():
        for qk in qk_maps(model):  # ... but dt = 0, or the invertible maps back at identity
            if isinstance(qk, Invertible):
                qk.st1.a.zero_()
                qk.st2.a.zero_()
            else:
                qk.dt.zero_()
    idx = idx_batch()
    assert torch.equal(model(idx)[0], ref(idx)[0])
    # and the default initialization is not the identity for the integrators (the test above can fail)
    if not attn.endswith('invertible'):
        assert not torch.allclose(build(attn, seed=1)(idx)[0], ref(idx)[0], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the Hamiltonian dynamics, on their own: tensors shaped (B, n_head, T, head_dim)

def hamiltonian(integrator, steps=1, hs=8, nh=3, seed=0, cls=Hamiltonian):
    torch.manual_seed(seed)
    h = cls(nh, hs, 6, steps, integrator).double()
    with torch.no_grad():
        h.dt.copy_(torch.tensor([0.3, -0.5, 0.8][:nh], dtype=torch.float64))
        h.V.a.mul_(3.0)  # a strong potential, so the force matters
        h.V.b.normal_()
    return h


def qk_pair(B=2, nh=3, T=5, hs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64),
            torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64))


def test_closed_form_force_equals_autograd_gradient_of_potential():
    h = hamiltonian('leapfrog')
    q, _ = qk_pair()
    q.requires_grad_(True)
    (grad,) = torch.autograd.grad(h.V(q).sum(), q)  # V(q), summed over tokens
    assert torch.allclose(h.force(q), -grad, atol=1e-12)
    assert grad.abs().max() > 1e-2
    scale = h.dt.view(-1, 1, 1)  # the integrators fold dt into the potential's a: same as scaling after
    assert torch.allclose(h.force(q, scale), scale * h.force(q), atol=1e-12)


def test_leapfrog_under_bfloat16_autocast():
    model = build('coupled')
    idx = idx_batch()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        loss = model(idx, targets=idx)[1]
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - math.log(50)) < 1.0
    for qk in qk_maps(model):
        assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in qk.parameters())


@pytest.mark.parametrize('steps', [1, 3, 7])
def test_leapfrog_is_reversible(steps):
    h = hamiltonian('leapfrog', steps)
    q, k = qk_pair()
    q1, k1 = h(q, k)
    assert (q1 - q).abs().max() > 0.1  # it moved
    q0, k0 = h.inverse(q1, k1)
    assert torch.allclose(q0, q, atol=1e-6, rtol=0) and torch.allclose(k0, k, atol=1e-6, rtol=0)


def test_euler_is_not_reversible_by_negating_dt():
    h = hamiltonian('euler')
    q, k = qk_pair()
    q0, k0 = h(*h(q, k), dt=-h.dt)
    assert not torch.allclose(q0, q, atol=1e-3)
    with pytest.raises(ValueError):
        h.inverse(q, k)


def jacobian(h, hs, seed=3):
    """J = d(q', k')/d(q, k) for one token of one head (nh=1, B=1, T=1), in float64: (2 hs, 2 hs)."""
    def f(x):
        q1, k1 = h(x[:hs].view(1, 1, 1, hs), x[hs:].view(1, 1, 1, hs))
        return torch.cat((q1.flatten(), k1.flatten()))
    x = torch.randn(2 * hs, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.functional.jacobian(f, x)


def jacobian_det(h, hs):
    return torch.linalg.det(jacobian(h, hs)).item()


@pytest.mark.parametrize('steps', [1, 4])
def test_leapfrog_preserves_volume_and_euler_does_not(steps):
    hs = 4
    leap, euler = hamiltonian('leapfrog', steps, hs=hs, nh=1), hamiltonian('euler', steps, hs=hs, nh=1)
    assert abs(jacobian_det(leap, hs) - 1.0) < 1e-10
    assert abs(jacobian_det(euler, hs) - 1.0) > 1e-3


@pytest.mark.parametrize('steps', [1, 4])
def test_leapfrog_is_symplectic_and_euler_is_not(steps):
    # the definition: J^T Omega J = Omega for the map's Jacobian J, Omega = [[0, I], [-I, 0]]
    hs = 4
    omega = torch.zeros(2 * hs, 2 * hs, dtype=torch.float64)
    omega[:hs, hs:], omega[hs:, :hs] = torch.eye(hs), -torch.eye(hs)
    for seed in (3, 4, 5):  # three tokens
        leap, euler = jacobian(hamiltonian('leapfrog', steps, hs=hs, nh=1), hs, seed), \
            jacobian(hamiltonian('euler', steps, hs=hs, nh=1), hs, seed)
        assert (leap.T @ omega @ leap - omega).abs().max() < 1e-12
        assert (euler.T @ omega @ euler - omega).abs().max() > 1e-2


def test_leapfrog_energy_drift_is_small_and_euler_drifts():
    # symplectic integrators keep H(q, k) = |k|^2/2 + V(q) nearly constant over many steps; Euler does not
    leap, euler = hamiltonian('leapfrog', 7), hamiltonian('euler', 7)
    with torch.no_grad():
        for h in (leap, euler):
            h.dt.fill_(0.05)
    q, k = qk_pair()
    e0 = leap.energy(q, k)
    drift = lambda h: (h.energy(*h(q, k)) - e0).abs().mean().item()
    assert drift(leap) < 0.1 * drift(euler)


def symplectic_error(h, hs=4, seed=3):  # |J^T Omega J - Omega| for one token, Omega = [[0, I], [-I, 0]]
    omega = torch.zeros(2 * hs, 2 * hs, dtype=torch.float64)
    omega[:hs, hs:], omega[hs:, :hs] = torch.eye(hs), -torch.eye(hs)
    J = jacobian(h, hs, seed)
    return (J.T @ omega @ J - omega).abs().max().item()


class Pendulum(Hamiltonian):  # exercise 1's: V(q) = -cos(q), F(q) = -sin(q)
    def force(self, q, scale=1.0):
        return -scale * torch.sin(q)


def pendulum_energy_error(integrator, dt):
    """The largest |H - H0| from rest at q = 1 to time 20, one call per step of dt."""
    h = Pendulum(1, 1, 1, 1, integrator, dt=dt).double()
    q, k = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    energy = lambda q, k: 0.5 * k.item() ** 2 - math.cos(q.item())
    e0, worst = energy(q, k), 0.0
    with torch.no_grad():
        for _ in range(round(20 / dt)):
            q, k = h(q, k)
            worst = max(worst, abs(energy(q, k) - e0))
    return worst


def check_promises(name):
    """What INTEGRATORS[name] declares, measured: symplectic, symmetric (-dt returns, inverse), order (pendulum)."""
    spec = INTEGRATORS[name]
    h = hamiltonian(name, 2, hs=4, nh=1)
    assert (max(symplectic_error(h, seed=s) for s in (3, 4)) < 1e-12) == spec.symplectic, name
    q, k = qk_pair(nh=1, hs=4)
    q0, k0 = h(*h(q, k), dt=-h.dt)
    assert ((q0 - q).abs().max() < 1e-10 and (k0 - k).abs().max() < 1e-10) == spec.symmetric, name
    if spec.symmetric:
        assert torch.allclose(h.inverse(*h(q, k))[0], q, atol=1e-10)
    else:
        with pytest.raises(ValueError, match='symmetric'):
            h.inverse(q, k)
    ratio = pendulum_energy_error(name, 0.1) / pendulum_energy_error(name, 0.05)
    assert 0.7 * 2 ** spec.order < ratio < 1.4 * 2 ** spec.order, (name, ratio)  # error ~ dt^order
    return ratio


@pytest.mark.parametrize('name', INTEGRATORS)
def test_each_integrator_keeps_what_its_entry_promises(name):
    # symplectic-euler (kick, then drift) is symplectic like leapfrog but, unlike it, first order and not symmetric
    check_promises(name)


def test_leapfrog_reuses_the_force_at_each_step_boundary_and_equals_kick_drift_kick():
    calls = []

    class Counted(Hamiltonian):
        def force(self, q, scale=1.0):
            calls.append(1)
            return super().force(q, scale)
    h = hamiltonian('leapfrog', 3, cls=Counted)
    q, k = qk_pair()
    q1, k1 = h(q, k)
    assert len(calls) == 3 + 1  # n + 1 forces, as the FLOP model says (not 2n)
    dt = h.dt.view(-1, 1, 1)
    q, k = (x.transpose(0, 1).reshape(3, -1, 8) for x in (q, k))
    for _ in range(3):  # kick-drift-kick, each force computed afresh: the same numbers, bit for bit
        k = k + h.force(q, dt / 2)
        q = q + dt * k
        k = k + h.force(q, dt / 2)
    q1, k1 = (x.transpose(0, 1).reshape(3, -1, 8) for x in (q1, k1))
    assert torch.equal(q1, q) and torch.equal(k1, k)


def test_an_unknown_integrator_is_an_error_at_construction_and_at_call():
    with pytest.raises(ValueError, match='leapfrog'):  # the message lists the names
        Hamiltonian(2, 4, 3, 1, 'yoshida')
    h = hamiltonian('leapfrog')
    h.integrator = 'yoshida'  # set after construction: an error, not a silent fallback to Euler
    with pytest.raises(ValueError, match='yoshida'):
        h(*qk_pair())
    with pytest.raises(ValueError, match='yoshida'):
        h.inverse(*qk_pair())


class Damped(Hamiltonian):  # a forker's change of the step: k <- (1 - gamma) k after each leapfrog step, gamma 0.2
    def step(self, q, k, dt, kick=None):
        q, k, kick = super().step(q, k, dt, kick)
        return q, 0.8 * k, kick


def test_an_overridden_step_is_taken_at_every_one_of_qk_steps():
    damped, one = hamiltonian('leapfrog', 3, cls=Damped), hamiltonian('leapfrog', 1)
    q, k = qk_pair()
    q1, k1 = damped(q, k)
    for _ in range(3):  # the intended map, written out: a step, then the damping, three times
        q, k = one(q, k)
        k = 0.8 * k
    assert torch.allclose(q1, q, atol=1e-12, rtol=0) and torch.allclose(k1, k, atol=1e-12, rtol=0)
    assert not torch.allclose(q1, hamiltonian('leapfrog', 3)(*qk_pair())[0], atol=1e-3)


def test_the_inherited_inverse_of_a_changed_step_refuses_instead_of_undoing_another_map():
    q, k = qk_pair()
    with pytest.raises(ValueError, match='Damped'):
        hamiltonian('leapfrog', 3, cls=Damped).inverse(q, k)

    class DampedForward(Hamiltonian):  # the same change written in forward
        def forward(self, q, k, dt=None):
            q, k = super().forward(q, k, dt)
            return q, 0.8 * k
    with pytest.raises(ValueError, match='DampedForward'):
        hamiltonian('leapfrog', 1, cls=DampedForward).inverse(q, k)
    pendulum = hamiltonian('leapfrog', 3, cls=Pendulum)  # a changed force keeps leapfrog's step: its inverse holds
    assert torch.allclose(pendulum.inverse(*pendulum(q, k))[0], q, atol=1e-10)


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
    q0, k0 = inv.inverse(q1, k1)
    assert torch.allclose(q0, q, atol=1e-10) and torch.allclose(k0, k, atol=1e-10)


@pytest.mark.parametrize('attn', QK_TRANSFORMS)
def test_qk_map_acts_per_token_and_is_callable_alone(attn):
    # the map of position t depends on position t only: shuffling positions commutes with it
    model = build(attn)
    randomize_qk(model)
    qk = qk_maps(model)[0]
    q, k = qk_pair(nh=4, T=6, hs=8)
    q, k = q.float(), k.float()
    perm = torch.randperm(6)
    q1, k1 = qk(q, k)
    q2, k2 = qk(q[:, :, perm], k[:, :, perm])
    assert q1.shape == q.shape and torch.allclose(q1[:, :, perm], q2, atol=1e-6)
    assert torch.allclose(k1[:, :, perm], k2, atol=1e-6)


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


def test_coupling_adds_the_papers_budget_at_60m():
    n_std, _ = count_60m('standard')
    n, n_qk = count_60m('coupled')
    assert n - n_std == n_qk and 55e6 < n_std < 70e6
    assert 0.0010 <= n_qk / n_std <= 0.0012  # the paper: 0.11%
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
            assert (id(p) in decayed) == (qk_decay and n.endswith(('.V.W', '.V.a'))), n
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
            assert (id(qk.mix.weight) in decayed) == (id(qk.V.W) in decayed) == qk_decay
            assert id(qk.mix.bias) not in decayed and id(qk.V.b) not in decayed and id(qk.dt) not in decayed


# ---------------------------------------------------------------------------------------------------------------
# the coupling diagnostic: how much of the q/k map is beyond what W_q, W_k could absorb

def diagnose(model):
    return qk_diagnostics(model, idx_batch(B=8, T=16))


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
            qk.V.W.mul_(0.1)
            qk.V.a.mul_(30.0)  # a strong force, so the map moves things (dk clearly > 0), but linearly
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


def test_qk_scale_sets_the_spread_of_the_potentials_pre_activations():
    cfg = tiny('coupled', qk_scale=2.0)
    model = GPT(cfg, verbose=False)
    q = 0.02 * math.sqrt(cfg.n_embd) * torch.randn(1, 4, 4096, 8)  # q's spread at initialization
    z = model.transformer.h[0].attn.qk.V.pre(q)
    assert 1.8 < z.std().item() < 2.2



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
            qk.V.a.mul_(2.0)
    idx = idx_batch()
    losses = []
    for m in (plain, doubled, scaled):
        loss = m(idx, targets=idx)[1]
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[2], abs=1e-6) and abs(losses[1] - losses[0]) > 1e-4
    for (n, p), q in zip(doubled.named_parameters(), scaled.parameters()):
        want = 2 * q.grad if n.endswith('.V.a') else q.grad
        assert torch.allclose(p.grad, want, atol=1e-6), n
    # and one optimizer step later the overridden model is still the doubled-a one
    for m in (doubled, scaled):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.step()
        m.zero_grad()
    assert doubled(idx, targets=idx)[1].item() != pytest.approx(losses[1], abs=1e-6)


def test_every_table_entry_builds_its_declared_class_integrator_width_and_cost():
    cfg = PRESETS['60m']
    base = flops_per_token(GPTConfig(**cfg), 512)
    for name, spec in QK_TRANSFORMS.items():
        for attn in (name, 'diff+' + name):
            model = build(attn, qk_hidden=8, qk_dt=0.25)
            for qk in qk_maps(model):
                assert type(qk) is spec.cls and getattr(qk, 'integrator', None) == spec.args(model.config).get(
                    'integrator'), attn
                assert not hasattr(qk, 'dt') or torch.equal(qk.dt, torch.full((4,), 0.25)), attn  # --qk_dt reaches it
                widths = {mlp.W.shape[1] for mlp in qk.modules() if isinstance(mlp, M.HeadMLP)}
                assert widths == {spec.width(8)}, attn
        assert all(f > 0 for f in spec.flops(64, spec.width(12), 1))
        assert flops_per_token(GPTConfig(attn=name, **cfg), 512) > base


def test_a_transform_added_to_the_table_alone_trains_is_costed_and_keeps_its_integrator(monkeypatch):
    # a forker's new variant: another leapfrog potential, twice as wide; nothing but the table entry
    coupled = QK_TRANSFORMS['coupled']
    monkeypatch.setitem(QK_TRANSFORMS, 'wide-leapfrog', QKTransform(Hamiltonian, coupled.args, lambda m: 2 * m,
                                                                    coupled.flops))
    assert 'wide-leapfrog' in attn_names() and 'diff+wide-leapfrog' in attn_names()
    for attn in ('wide-leapfrog', 'diff+wide-leapfrog'):
        m = build(attn)
        assert all(qk.integrator == 'leapfrog' and qk.V.W.shape[1] == 24 for qk in qk_maps(m))
        assert sum(p.numel() for p in m.qk_parameters()) == sum(p.numel() for p in build(attn.replace(
            'wide-leapfrog', 'coupled')).qk_parameters()) + 2 * 4 * (12 * 8 + 2 * 12)  # 2 layers x 4 heads x 12 more
        losses = adamw_losses(m)
        assert losses[-2] < losses[0] - 0.2
    cfg = GPTConfig(attn='wide-leapfrog', **PRESETS['60m'])
    assert flops_per_token(cfg, 512) > flops_per_token(GPTConfig(attn='coupled', **PRESETS['60m']), 512)
    r = run('-c', "import model, bench; from model import *; "
            "c = QK_TRANSFORMS['coupled']; "
            "model.QK_TRANSFORMS['wide-leapfrog'] = QKTransform(Hamiltonian, c.args, lambda m: 2 * m, c.flops); "
            "print(bench.flop_ratio(GPTConfig(attn='wide-leapfrog', **PRESETS['60m']), 512))")
    assert r.returncode == 0 and 1.0 < float(r.stdout) < 1.05, r.stderr  # bench's FLOP model tabulates it


def test_an_unknown_transform_is_an_error_in_the_flop_model_never_a_zero(monkeypatch):
    cfg = GPTConfig(attn='euler')
    monkeypatch.delitem(QK_TRANSFORMS, 'euler')
    with pytest.raises(ValueError, match='euler'):
        flops_per_token(cfg, 128)
    with pytest.raises(ValueError, match='euler'):
        GPTConfig(attn='euler')


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
    counted, priced = counted_and_priced_matmul_flops(name, steps)
    assert counted == priced > 0


W1 = 1 / (2 - 2 ** (1 / 3))  # Yoshida's weights: three leapfrog steps of w1 dt, w0 dt, w1 dt make a 4th-order step
W0 = -2 ** (1 / 3) * W1


def yoshida(h, q, k, dt, kick=None):  # each leapfrog hands the next its last kick, rescaled: 3n + 1 forces
    q, k, kick = M.leapfrog(h, q, k, W1 * dt, kick)
    q, k, kick = M.leapfrog(h, q, k, W0 * dt, kick * (W0 / W1))
    q, k, kick = M.leapfrog(h, q, k, W1 * dt, kick * (W1 / W0))
    return q, k, kick


def test_a_yoshida_integrator_added_through_the_tables_alone_trains_is_priced_and_is_fourth_order(monkeypatch):
    # a forker's new integrator: one entry of INTEGRATORS, one of QK_TRANSFORMS, no edit of model.py
    monkeypatch.setitem(INTEGRATORS, 'yoshida', Integrator(yoshida, symplectic=True, symmetric=True, order=4))
    monkeypatch.setitem(QK_TRANSFORMS, 'yoshida', QKTransform(
        Hamiltonian, lambda c: dict(integrator='yoshida', dt=c.qk_dt), lambda m: m,
        lambda hs, m, n: ((3 * n + 1) * 4 * m * hs, (3 * n + 1) * 10 * m + n * 20 * hs)))
    losses = adamw_losses(build('yoshida'))
    assert losses[-2] < losses[0] - 0.2
    for steps in (1, 3):
        counted, priced = counted_and_priced_matmul_flops('yoshida', steps)
        assert counted == priced
    cost = lambda attn: flops_per_token(GPTConfig(attn=attn, **PRESETS['60m']), 512) / flops_per_token(
        GPTConfig(**PRESETS['60m']), 512) - 1
    assert 0.009 < cost('yoshida') < 0.011 and 0.004 < cost('coupled') < 0.006  # +1.0% and +0.5% at 60m
    assert 12 < check_promises('yoshida') < 20  # the pendulum's energy error falls ~16x per halving of dt


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


def test_importing_bench_runs_nothing():  # no timing, no report, no output: bench.py works when run
    r = run('-c', 'import bench')
    assert r.returncode == 0 and r.stdout == r.stderr == ''
# ===============================================================================================================
# the scripts, run the way a user runs them

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish? \u00e9\u00e8\u2014 caf\u00e9\n") * 40


# Every run of a script is a process of its own, as `python script args` is: its own pid, argv, working folder,
# globals, stdout and stderr pipes, exit code and signals. On Linux it is forked from one warm Python that has
# already imported what the scripts import (torch, and the torch._dynamo that AdamW loads: seconds each time), so a
# run costs a fork, not those imports; elsewhere it is a fresh interpreter.

RUN = r"""
import json, os, runpy, signal, sys, threading, traceback
def run(r):  # run `python *r['argv']` in this process (just forked, or fresh), after the python code r['patch']
    argv, code = r['argv'], 0
    try:
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

ZYGOTE = RUN + r"""
import socket
import numpy, torch, torch.distributed, torch.nn.parallel, model, prepare_data  # what train.py imports
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # which imports torch._dynamo
sock = socket.socket(fileno=int(sys.argv[1]))


def reap(*_):  # each run that ended: its exit code, or minus the signal that ended it, as subprocess says
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        if pid in running:
            sock.send(json.dumps(dict(id=running.pop(pid), code=os.waitstatus_to_exitcode(status))).encode())


signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the tests reaches the runs, not this server
signal.signal(signal.SIGCHLD, reap)
running = {}  # pid: the run's id
while True:
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)  # a run, and the write ends of its stdout and stderr
    if not msg:  # the tests are over: so are the runs they left
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for pid in running:
            os.kill(pid, signal.SIGKILL)
        break
    r = json.loads(msg)
    sys.stdout.flush(), sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # no run is reaped before it is counted
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        sock.close()
        try:
            os.dup2(fds[0], 1), os.dup2(fds[1], 2)
            run(r)
        finally:
            os._exit(1)  # never back into this loop
    running[pid] = r['id']
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    for fd in fds:
        os.close(fd)
    sock.send(json.dumps(dict(id=r['id'], pid=pid)).encode())
"""
FORK = sys.platform == 'linux'  # macOS: forking after torch's import is unsafe


class Warm:
    """The warm Python, started at the first run: it forks each run and says its pid, and later its exit code."""

    def __init__(self):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = subprocess.Popen([sys.executable, '-c', ZYGOTE, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                       cwd=HERE, stdin=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS='1'))
        theirs.close()
        self.news, self.changed, self.ids = {}, threading.Condition(), itertools.count()
        threading.Thread(target=self.listen, daemon=True).start()

    def listen(self):
        while msg := self.sock.recv(1 << 16):
            m = json.loads(msg)
            with self.changed:
                self.news[('pid' if 'pid' in m else 'code', m['id'])] = m.get('pid', m.get('code'))
                self.changed.notify_all()
        self.server.wait()  # it has stopped: no waiting for answers that will not come
        with self.changed:
            self.changed.notify_all()

    def answer(self, key, timeout):  # ('pid', id): a started run's pid; ('code', id): its exit code (None: not yet)
        with self.changed:
            self.changed.wait_for(lambda: key in self.news or self.server.poll() is not None, timeout)
            assert self.server.poll() is None, 'the warm Python that forks the runs has stopped'
            return self.news.pop(key, None)


def warm(started=[], lock=threading.Lock()):  # one per session, whichever thread asks first
    with lock:
        if not started:
            started.append(Warm())
        return started[0]


class Forked:
    """A run forked by the warm Python, used as a subprocess.Popen is (it is not this process's child)."""

    def __init__(self, request):
        (out, out_w), (err, err_w) = os.pipe(), os.pipe()
        self.id = request['id'] = next(warm().ids)
        socket.send_fds(warm().sock, [json.dumps(request).encode()], [out_w, err_w])
        os.close(out_w), os.close(err_w)
        self.args, self.returncode = request['argv'], None
        self.stdout, self.stderr = open(out, errors='replace'), open(err, errors='replace')
        self.pid = warm().answer(('pid', self.id), timeout=120)

    def poll(self):
        if self.returncode is None:
            self.returncode = warm().answer(('code', self.id), timeout=0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = warm().answer(('code', self.id), timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
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


def start(*argv, cwd=HERE, env=None, patch='', sigint_ignored=False, fsize=0):
    """`python *argv` (a script and its arguments, or -c code, or -m module), started; a Popen. patch: python code
    run first (e.g. to make the checkpoint write slow); sigint_ignored: as a shell's background job inherits it."""
    request = dict(argv=[os.fsdecode(a) for a in argv], cwd=str(cwd), env=env or {}, patch=patch,
                   sigint_ignored=sigint_ignored, fsize=fsize)
    if FORK and not any(k.startswith('PYTHON') for k in request['env']):  # (those are read at an interpreter's start)
        return Forked(request)
    return subprocess.Popen([sys.executable, '-c', RUN + 'run(json.loads(sys.argv[1]))', json.dumps(request)],
                            cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors='replace', env=dict(os.environ, OMP_NUM_THREADS='1', **request['env']))


def run(*argv, timeout=240, **kw):
    """`python *argv`, run to its end; a CompletedProcess."""
    p = start(*argv, **kw)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def scripts(*calls, **kw):  # each call (script, arg, ...) run, one after another
    return [run(*call, **kw) for call in calls]


def one_line_error(r, words):
    err = r.stderr.strip()
    return r.returncode != 0 and 'Traceback' not in r.stderr and '\n' not in err and words in err


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
    assert json.load(open(out / 'meta.json'))['tokenizer'] == 'bytes'


def test_prepare_round_trip_gpt2_through_offline_cache(tmp_path):
    if not os.environ.get('TIKTOKEN_CACHE_DIR'):
        pytest.skip('TIKTOKEN_CACHE_DIR is not set: the gpt2 tokenizer would need the network')
    import tiktoken
    docs = [{'text': f"Abstract {i:02}: coupled dynamics of queries and keys, trial {i:02}.\n" * 3} for i in range(30)]
    src = tmp_path / 'abstracts.jsonl'
    src.write_text('\n'.join(json.dumps(d) for d in docs) + '\n')
    meta = prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path / 'data'), tokenizer='gpt2')
    assert meta['vocab_size'] == 50257 and meta['eot_token'] == 50256
    out = tmp_path / 'data' / 'abstracts'
    enc = tiktoken.get_encoding('gpt2')
    tokens = np.concatenate([read_bin(out / 'train.bin'), read_bin(out / 'val.bin')]).tolist()
    assert tokens.count(50256) == len(docs)  # one end-of-text after every document
    texts = enc.decode(tokens).split('<|endoftext|>')[:-1]
    assert sorted(texts) == sorted(d['text'] for d in docs)


def test_prepare_does_not_redo_finished_work(tmp_path):
    src = tmp_path / 'play.txt'
    src.write_text(TEXT)
    prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path))
    stamp = os.path.getmtime(tmp_path / 'play' / 'train.bin')
    r = run('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path}')
    assert r.returncode == 0 and 'already prepared' in r.stdout
    assert os.path.getmtime(tmp_path / 'play' / 'train.bin') == stamp
    (tmp_path / 'play' / 'meta.json').write_text('{"tokens": [1, 2')  # a corrupt meta.json: simply redo
    r = run('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path}')
    assert r.returncode == 0 and 'redoing' in r.stdout and json.load(open(tmp_path / 'play' / 'meta.json'))['bytes']


def test_prepare_failure_leaves_no_partial_output(tmp_path, monkeypatch):
    src = tmp_path / 'docs'
    src.mkdir()
    (src / 'a.jsonl').write_text(json.dumps({'text': 'one ' * 200}) + '\n' + json.dumps({'text': 'two ' * 200}))
    prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path / 'data'))
    out = tmp_path / 'data' / 'docs'
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    # 1) corrupt input on a forced redo: one clear line, and the finished dataset is untouched
    (src / 'b.jsonl').write_text('{"text": "three"}\nnot json\n')
    r = run('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path / "data"}', '--force')
    assert one_line_error(r, 'b.jsonl:2')
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    # 2) interrupted, or failing (a full disk), in the middle of writing tokens: no temp file, old data intact
    (src / 'b.jsonl').write_text('{"text": "three"}\n' * 100)
    real = prepare_data.write_tokens
    for error in (KeyboardInterrupt(), OSError(28, 'No space left on device')):
        def write_then_fail(tmp, docs, tok):
            real(tmp, docs[:1], tok)  # a partial file exists when the failure comes
            raise error
        monkeypatch.setattr(prepare_data, 'write_tokens', write_then_fail)
        with pytest.raises(type(error)):
            prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path / 'data'), force=True)
        assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    # 3) a failure on a fresh name leaves no directory behind
    r = run('prepare_data.py', f'--input={tmp_path / "missing.txt"}', f'--data_dir={tmp_path / "data"}')
    assert r.returncode != 0 and not (tmp_path / 'data' / 'missing').exists()


def test_prepare_ctrl_c_at_work_removes_what_it_began(tmp_path):
    src = tmp_path / 'docs'
    src.mkdir()
    (src / 'a.jsonl').write_text('{"text": "one"}\n')
    stuck = 'import json, time\njson.loads = lambda *a, **k: time.sleep(120)'  # at work, reading, when stopped
    p = start('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path / "data"}', patch=stuck)
    wait_for(tmp_path / 'data' / 'docs', timeout=30)
    time.sleep(0.2)  # past the folder's creation, into the read
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and 'Traceback' not in err, err
    assert err.strip() == 'interrupted: no partial output was kept; run the same command again'
    assert not (tmp_path / 'data').exists()  # the folders it made are gone


@pytest.mark.skipif(not hasattr(os, 'mkfifo'), reason='needs a named pipe')
def test_prepare_reads_linked_folders_skips_special_files_and_a_bom_in_one_line(tmp_path):
    src, other = tmp_path / 'docs', tmp_path / 'other'
    src.mkdir(), other.mkdir()
    os.mkfifo(src / 'a.txt')  # reading it would wait for a writer that never comes
    (src / 'b.jsonl').write_text('\ufeff' + json.dumps({'text': TEXT}) + '\n', encoding='utf-8')  # a BOM first
    (other / 'c.txt').write_text(TEXT)
    os.symlink(other, src / 'linked')
    os.symlink(src, other / 'loop')  # a loop of links: each folder read once
    r = run('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path / "data"}', timeout=60)
    assert r.returncode == 0 and r.stdout.count('note: skipped') == 1 and 'a.txt: not a regular file' in r.stdout
    tokens = np.concatenate([read_bin(tmp_path / 'data' / 'docs' / f'{s}.bin') for s in ('train', 'val')])
    assert (tokens == 256).sum() == 3 and len(tokens) == 2 * len(TEXT.encode()) + 3  # b, c, and c's cut
    # a dotfile names its folder without the dot; debris that names no process is left alone
    (tmp_path / '.notes.txt').write_text(TEXT)
    (tmp_path / 'data' / 'notes').mkdir()
    (tmp_path / 'data' / 'notes' / 'junk.tmp99999999999999999999').write_text('mine')
    r = run('prepare_data.py', f'--input={tmp_path / ".notes.txt"}', f'--data_dir={tmp_path / "data"}')
    assert r.returncode == 0 and (tmp_path / 'data' / 'notes' / 'junk.tmp99999999999999999999').exists()


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


def test_a_split_too_small_to_train_or_evaluate_on_is_refused(tmp_path):
    (tmp_path / 'tiny.txt').write_text('x' * 300)  # val: 30 bytes
    with pytest.raises(prepare_data.DataError, match='val split would hold only 31 tokens.*larger --val_fraction'):
        prepare_data.prepare(None, input=str(tmp_path / 'tiny.txt'), data_dir=str(tmp_path))
    assert not (tmp_path / 'tiny').exists()


PINNED = {  # sha256 of the README's corpora's token files, as prepared since the laptop table's runs
    'shakespeare': ('tinyshakespeare/input.txt', 'f15494575ff4787ada05a2f612ca4aed7bc4ff26df0f824c2832b3051c7889aa',
                    'c05585963b772a0c69463c68b510fe39e162322d6f30b0c3a297f2ebc250f818'),
    'pubmed': ('pubmed/ori_pqal.json', '4e85f43e2913355a9171a66c0ee1cd1a1003b27d27805ccb8bf953f5108dceb3',
               '305a4e61b5eb726da0800cf796f8b9efaa9c8d355c9282a9ef2cbbad3bacbfde'),
    'web': ('web/c4-sample.00000-of-00001.json.gz', '12e9563bd61f85f27878c3c1f13ce5d25fb801b4a0e111566b8b4275e7a1a5c4',
            '70ca8d58f88308201d1d39ae0c460d65fa7e4f2df4cc433b75cb556c79c55f1a'),
    'pydocs': ('3.11.7', 'e931b7c5241eb0b313934b87cfe34e55594796c8903f50302c31f1953eeff005',  # this Python's docs
               '5532d1eb6ee1913bd0a0f3efe51f7af87c0df2d95999249766c710f078fb3446'),
}


@pytest.mark.parametrize('name', PINNED)
def test_the_readme_corpora_split_as_they_always_did(corpus, tmp_path, name):
    # WikiText comes split: its splits are the archive's files, as test_wikitext_zip_with_the_archives_layout checks
    source, *want = PINNED[name]
    if name == 'pydocs':
        if platform.python_version() != source:
            pytest.skip(f"pydocs is pinned for Python {source}'s docs")
        assert [PREPARED['pydocs'][s] for s in ('train', 'val')] == want
        return
    path = os.path.join(os.path.dirname(HERE), 'shared', 'data', source)  # the project's offline copies, if here
    if not os.path.exists(path):
        pytest.skip(f"no offline copy of {name}'s source here")
    meta = prepare_data.prepare(name, input=path, data_dir=str(tmp_path))
    assert [prepare_data.sha256_of(tmp_path / name / f'{s}.bin') for s in ('train', 'val')] == want
    assert meta['fingerprint'] == prepare_data.fingerprint({s: tmp_path / name / f'{s}.bin' for s in meta['tokens']})


def test_prepare_removes_what_a_killed_run_left(tmp_path):
    src = tmp_path / 'play.txt'
    src.write_text(TEXT)
    out = tmp_path / 'play'
    out.mkdir()
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
    debris = [out / f'train.bin.tmp{dead.stdout.strip()}', out / f'ckpt.pt.tmp{dead.stdout.strip()}']
    for f in debris:
        f.write_bytes(b'half')
    prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path))
    assert not any(f.exists() for f in debris) and not [f for f in os.listdir(out) if '.tmp' in f]


@pytest.mark.parametrize('args, words', [
    (['--name=../../x'], 'plain folder name'),
    (['--name=/tmp/elsewhere'], 'plain folder name'),
    (['--name=.'], 'plain folder name'),
    (['nocorpus'], 'unknown corpus'),
    (['--data_dir=FILE/sub'], 'cannot write'),
])
def test_prepare_bad_input_gives_one_line_and_writes_nothing_outside(tmp_path, args, words):
    src = tmp_path / 'play.txt'
    src.write_text(TEXT)
    (tmp_path / 'FILE').write_text('a file where a folder should be')
    args = [a.replace('FILE', str(tmp_path / 'FILE')) for a in args]
    r = run('prepare_data.py', f'--input={src}', *([] if any('data_dir' in a for a in args) else
                                                    [f'--data_dir={tmp_path / "data"}']), *args)
    assert one_line_error(r, words)
    assert sorted(os.listdir(tmp_path)) in (['FILE', 'play.txt'], ['FILE', 'data', 'play.txt'])
    assert not os.path.exists(tmp_path / 'x') and not os.path.exists('/tmp/elsewhere/meta.json')


def test_prepare_refuses_a_lone_surrogate_in_one_line(tmp_path):
    src = tmp_path / 'bad.jsonl'
    src.write_text('{"text": "fine"}\n{"text": "broken \\ud800 text"}\n')
    r = run('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path / "data"}')
    assert one_line_error(r, 'bad.jsonl:2') and 'surrogate' in r.stderr and not (tmp_path / 'data' / 'bad').exists()


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
    monkeypatch.setattr(prepare_data.time, 'sleep', lambda s: None)
    with pytest.raises(prepare_data.DataError, match='sha256'):
        prepare_data.prepare(name, data_dir=str(tmp_path / 'other'))
    assert not (tmp_path / 'other' / name).exists()


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
    r = run('-c', 'import prepare_data, sys; prepare_data.time.sleep = lambda s: None; '
            'prepare_data.CORPORA["pubmed"]["url"] = "http://127.0.0.1:9/ori_pqal.json"; '
            f'sys.argv = ["prepare_data.py", "pubmed", "--data_dir={tmp_path / "data"}"]; '
            'exec(open("prepare_data.py").read())')
    assert r.returncode != 0 and 'Traceback' not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert '--input=<path to ori_pqal.json>' in r.stderr and not (tmp_path / 'data').exists()  # nothing left
    blob, items = pubmed_fixture()
    (tmp_path / 'ori_pqal.json').write_bytes(blob)
    r = run('prepare_data.py', 'pubmed', f'--input={tmp_path / "ori_pqal.json"}', f'--data_dir={tmp_path / "data"}')
    assert r.returncode == 0 and 'not byte for byte' in r.stdout  # a fixture, not the real file: said, then used
    assert json.load(open(tmp_path / 'data' / 'pubmed' / 'meta.json'))['corpus'] == 'pubmed'


@pytest.mark.parametrize('name, fn, blob', [
    ('web', 'ori_pqal.json', lambda: pubmed_fixture()[0]),                  # PubMedQA's JSON as "web"
    ('shakespeare', 'c4.json.gz', lambda: web_fixture()[0]),                # C4 pages as "shakespeare"
    ('shakespeare', 'c4.jsonl', lambda: gzip.decompress(web_fixture()[0])),  # the same, unzipped
    ('pubmed', 'input.txt', lambda: TEXT.encode()),                         # a play as "pubmed"
])
def test_a_named_corpus_from_the_wrong_file_is_refused_in_one_line(tmp_path, name, fn, blob):
    (tmp_path / fn).write_bytes(blob())
    r = run('prepare_data.py', name, f'--input={tmp_path / fn}', f'--data_dir={tmp_path / "data"}')
    assert one_line_error(r, f"is not the {name} corpus's file") and not (tmp_path / 'data').exists()
    assert 'using it anyway' not in r.stdout


# ---------------------------------------------------------------------------------------------------------------
# train.py

SMALL = ['--n_layer=2', '--batch_size=4', '--block_size=32', '--eval_iters=2', '--log_interval=1', '--sample_tokens=0']

def train(corpus, out_dir, *args, timeout=240, **kw):  # one train.py in a process of its own
    return run('train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}', *SMALL, *args, timeout=timeout, **kw)


def trains(corpus, out_dir, *args):  # train.py and its arguments, for run(), start(), scripts()
    return ('train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}', *SMALL, *args)


def metrics(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, 'metrics.jsonl'))]


def test_resume_continues_and_reproduces_the_uninterrupted_run(corpus, tmp_path):
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


def test_resume_and_eval_take_every_setting_from_the_checkpoint(corpus, tmp_path):
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


def test_full_split_evaluation_equals_an_independent_computation(corpus, tmp_path):
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


def test_training_lowers_validation_loss_and_logs_progress_and_the_coupling(corpus, tmp_path):
    r = train(corpus, tmp_path, '--max_iters=40', '--eval_interval=20', '--attn=coupled', '--learning_rate=1e-3',
              '--warmup_iters=10', '--dropout=0')  # (dropout 0 is a valid float: 0 once was refused)
    assert r.returncode == 0
    line = [x for x in r.stdout.splitlines() if x.startswith('iter 40/40')][0]
    assert all(w in line for w in ('loss', 'lr', 'ms/iter', 'tok/s', 'eta')) and '| mfu' not in line  # CPU: no MFU
    assert 'q/k map: nonlinear' in r.stdout
    evals = [m for m in metrics(tmp_path) if m['event'] == 'eval']
    assert len(evals) == 3 and evals[-1]['val_loss'] < evals[0]['val_loss'] - 1.0
    for e in evals:  # every eval carries the per-layer coupling diagnostic, with the step sizes
        assert len(e['qk']) == 2 and all(len(s['dt']) == 4 and 0 <= s['nonlinear'] for s in e['qk'])


BAD_FLAGS = [
    (['--attn=hamiltonian'], 'not one of'), (['--flux=3'], 'unknown flag --flux'),
    (['--batch_size=four'], 'expects an integer'), (['--dropout=zero'], 'expects a number'),
    (['--compile=maybe'], 'True or False'), (['--max_iters', '5'], '--key=value'), (['--n_head=3'], 'not divisible'),
    (['--attn=diff', '--n_head=1', '--n_embd=64'], 'even'), (['--qk_steps=9'], '1..7'),
    (['--block_size=10000000'], 'lower --block_size'), (['--dataset=nowhere'], 'prepare_data.py'),
    (['--init_from=resume'], 'no checkpoint'), (['--eval_only=True'], 'no checkpoint'),
    (['--device=cuda'], 'CUDA is not available'), (['--device=mps'], 'MPS is not available'),
    (['--device=tpu'], 'unknown'), (['--out_dir='], 'empty'), (['--out_dir=FILE'], 'is not a folder'),
    (['--out_dir=FILE/sub'], 'cannot write'), (['--out_dir=LINK'], 'is not a folder but a link to'),
    # every number is checked for its meaning
    (['--beta1=2'], '--beta1'), (['--beta2=-1'], '--beta2 must be >= 0'), (['--seed=99999999999999999999999'], '--seed'),
    (['--lr_decay_iters=-5'], '--lr_decay_iters must be >= 0'), (['--time_budget=nan'], '--time_budget must be >= 0 and finite'),
    (['--grad_clip=nan'], '--grad_clip must be >= 0 and finite'), (['--learning_rate=inf'], '> 0 and finite'),
    (['--learning_rate=0'], '--learning_rate must be > 0'), (['--warmup_iters=-1'], '>= 0'),
]


@pytest.fixture(scope='module')
def bad_flag_runs(corpus, tmp_path_factory):
    d = tmp_path_factory.mktemp('bad_flags')
    (d / 'FILE').write_text('a file where a folder should be')
    os.symlink(d / 'nowhere', d / 'LINK')  # a link to nothing
    calls = [('train.py', f'--data_dir={corpus}', *SMALL, *([] if any('out_dir' in a for a in args) else
                                                            [f'--out_dir={d / "out"}']),
              *[a.replace('FILE', str(d / 'FILE')).replace('LINK', str(d / 'LINK')) for a in args])
             for args, words in BAD_FLAGS]
    *rs, help = scripts(*calls, ('train.py', '--help'))
    return dict(zip([tuple(args) for args, words in BAD_FLAGS], rs)), d, help


@pytest.mark.parametrize('args, words', BAD_FLAGS)
def test_bad_flags_give_one_clear_line(bad_flag_runs, args, words):
    if ('--device=cuda' in args and torch.cuda.is_available()) or ('--device=mps' in args and
                                                                     torch.backends.mps.is_available()):
        pytest.skip('that device is available here')
    r = bad_flag_runs[0][tuple(args)]
    assert one_line_error(r, words) and r.stderr.startswith('error:'), r.stderr
    assert not (bad_flag_runs[1] / 'out' / 'ckpt.pt').exists()


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


def test_bad_data_and_checkpoints_are_refused_clearly_and_a_run_is_never_overwritten(corpus, tmp_path):
    meta = json.load(open(os.path.join(corpus, 'pydocs', 'meta.json')))
    bad = {  # a data folder each: what is wrong with it, and the words its one-line refusal must hold
        'truncated': ({}, lambda d: open(d / 'train.bin', 'r+b').truncate(1001), 'truncated or corrupt'),
        'tokens_wrong_type': (dict(tokens='many'), None, 'meta.json is corrupt'),
        'no_counts': (dict(tokens={}), None, 'meta.json is corrupt'),
        'bytes_not_a_number': (dict(bytes=dict(train='lots', val=1)), None, 'meta.json is corrupt'),
        'huge_vocab': (dict(vocab_size=10 ** 9), None, 'meta.json is corrupt'),
        'int32': (dict(dtype='int32'), None, 'meta.json is corrupt'),
        'int32_bin': ({}, lambda d: (d / 'val.bin').write_bytes(read_bin(d / 'val.bin').astype(np.int32).tobytes()),
                      'truncated or corrupt'),
        'val_is_a_folder': ({}, lambda d: (os.remove(d / 'val.bin'), os.mkdir(d / 'val.bin')), 'not a file'),
        'small_vocab': (dict(vocab_size=200), None, '--force'),  # bytes >= 200 in the data
    }
    for name, (change, damage, words) in bad.items():
        d = tmp_path / name / 'pydocs'
        os.makedirs(d)
        for f in ('train.bin', 'val.bin'):
            (d / f).write_bytes(open(os.path.join(corpus, 'pydocs', f), 'rb').read())
        (d / 'meta.json').write_text(json.dumps(meta | change))
        if damage:
            damage(d)
    out = tmp_path / 'out'
    rs = scripts(*[('train.py', f'--data_dir={tmp_path / name}', f'--out_dir={tmp_path / "o" / name}', '--max_iters=1')
                   for name in bad],
                 trains(corpus, out, '--max_iters=2', '--eval_interval=1', '--attn=coupled'),
                 trains(corpus, out, '--max_iters=2'),  # a scratch run in a run's folder
                 trains(corpus, out, '--init_from=resume', '--attn=diff'))  # a checkpoint of another architecture
    for (name, (change, damage, words)), r in zip(bad.items(), rs):
        assert one_line_error(r, words), (name, r.stderr)
        assert not (tmp_path / 'o' / name / 'ckpt.pt').exists()  # refused before training
    trained, scratch, other = rs[len(bad):]
    assert trained.returncode == 0, trained.stderr
    assert one_line_error(scratch, '--init_from=resume') and one_line_error(other, "--attn='diff' here but 'coupled'")
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)  # the refused runs touched neither it nor the log
    assert ckpt['iter_num'] == 2 and ckpt['config']['attn'] == 'coupled'
    assert [m['event'] for m in metrics(out)].count('start') == 1 and metrics(out)[-1]['event'] == 'final'
    broken = {  # a checkpoint each, broken one way
        'no_optimizer': {k: v for k, v in ckpt.items() if k != 'optimizer'},
        'iter_num': ckpt | dict(iter_num='forty'), 'best_val_loss': ckpt | dict(best_val_loss='low'),
        'learning_rate': ckpt | dict(config=ckpt['config'] | dict(learning_rate='fast')),
        'n_head': ckpt | dict(model_args=ckpt['model_args'] | dict(n_head='four')),
        'rng': ckpt | dict(rng=[dict(ckpt['rng'][0], torch=torch.zeros(3, dtype=torch.uint8))]),
        'names': ckpt | dict(model={k.replace('.V.W', '.V.c_fc'): v for k, v in ckpt['model'].items()}),
        'garbage': b'not a checkpoint',
        'iter_num_negative': ckpt | dict(iter_num=-5), 'best_val_loss_nan': ckpt | dict(best_val_loss=math.nan),
        'dtype_bogus': ckpt | dict(config=ckpt['config'] | dict(dtype='bogus')),
        'one_rank_of_two': ckpt | dict(world_size=2),  # a 2-rank run's checkpoint with one rank's random state
    }
    for name, c in broken.items():
        os.makedirs(tmp_path / 'ck' / name)
        if isinstance(c, bytes):
            (tmp_path / 'ck' / name / 'ckpt.pt').write_bytes(c)
        else:
            torch.save(c, tmp_path / 'ck' / name / 'ckpt.pt')
    rs = scripts(*[trains(corpus, tmp_path / 'ck' / name, '--init_from=resume', '--max_iters=4') for name in broken])
    for name, r in zip(broken, rs):
        words = {'names': 'another version of model.py', 'iter_num_negative': 'is corrupt: iter_num=-5',
                 'best_val_loss_nan': 'is corrupt: best_val_loss=nan', 'dtype_bogus': "dtype='bogus' is not one of",
                 'one_rank_of_two': 'lacks a random state per rank'}.get(name, 'ckpt.pt')
        assert one_line_error(r, words), (name, r.stderr)


def test_a_run_names_its_corpus_and_another_text_under_that_name_is_refused(tmp_path):
    data, out = tmp_path / 'data', tmp_path / 'out'
    for i, name in enumerate(('a.txt', 'b.txt')):
        (tmp_path / name).write_text(TEXT[i:] * 3)
    fp = prepare_data.prepare(None, input=str(tmp_path / 'a.txt'), name='sx', data_dir=str(data))['fingerprint']
    trained, again, forced, evaluated, resumed = scripts(
        trains(data, out, '--dataset=sx', '--max_iters=2', '--eval_interval=2'),
        ('prepare_data.py', f'--input={tmp_path / "b.txt"}', '--name=sx', f'--data_dir={data}'),
        ('prepare_data.py', f'--input={tmp_path / "b.txt"}', '--name=sx', f'--data_dir={data}', '--force'),
        trains(data, out, '--eval_only=True'), trains(data, out, '--init_from=resume', '--max_iters=4'))
    assert trained.returncode == 0 and forced.returncode == 0, trained.stderr + forced.stderr
    assert torch.load(out / 'ckpt.pt', weights_only=True)['fingerprint'] == fp == metrics(out)[0]['fingerprint']
    assert one_line_error(again, "prepared from other input (the source and the input's content differ); --force")
    for r in (evaluated, resumed):
        assert one_line_error(r, f"as it was then (corpus fingerprint {fp[:12]}), and that folder now holds other")
    assert [m['event'] for m in metrics(out)].count('start') == 1
    # the same file, changed: needs --force too; token files changed after preparation: the loader says so
    (tmp_path / 'b.txt').write_text(TEXT * 4)
    with pytest.raises(prepare_data.DataError, match=r"\(the input's content differs\); --force"):
        prepare_data.prepare(None, input=str(tmp_path / 'b.txt'), name='sx', data_dir=str(data))
    tokens = read_bin(data / 'sx' / 'val.bin')
    tokens[:2] = tokens[1::-1] + (tokens[0] == tokens[1])  # same size, same vocabulary, other text
    tokens.tofile(data / 'sx' / 'val.bin')
    with pytest.raises(prepare_data.DataError, match='fingerprint differs.*--force'):
        prepare_data.load(str(data), 'sx', 32)


def test_a_best_only_checkpoint_says_what_it_holds_and_the_final_evaluation_scores_it(corpus, tmp_path):
    out = tmp_path / 'out'
    assert train(corpus, out, '--max_iters=2', '--eval_interval=2').returncode == 0
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    torch.save(ckpt | dict(best_val_loss=1e-3), out / 'ckpt.pt')  # a best estimate that no later one beats
    extended, evaluated, seeded = scripts(
        trains(corpus, out, '--init_from=resume', '--max_iters=4', '--eval_interval=1',
               '--always_save_checkpoint=False'),
        trains(corpus, out, '--eval_only=True'), trains(corpus, out, '--init_from=resume', '--seed=2'))
    assert extended.returncode == 0, extended.stderr
    assert f"checkpoint {out / 'ckpt.pt'} at iteration 2 (val loss {ckpt['val_loss']:.4f}, the best" in extended.stdout
    final = metrics(out)[-1]
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 2
    assert (final['iter'], final['model_iter'], final['model_tokens']) == (4, 2, ckpt['tokens'])
    assert f"ppl {final['val_ppl']:.3f}" in evaluated.stdout  # --eval_only scores the model the final record scored
    assert one_line_error(seeded, '--seed=2 here but the run started with seed 1337')


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


def test_ctrl_c_says_where_to_resume(corpus, tmp_path):
    out = tmp_path / 'a run'  # a space: the hint quotes it, so it can be pasted
    p = start(*trains(corpus, out, '--max_iters=100000', '--eval_interval=5'))
    wait_for(out / 'ckpt.pt')
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    last, _ = stopped_cleanly(p)
    assert last.startswith('interrupted at iteration') and '--init_from=resume' in last
    command = last.split('Continue with: ')[1]
    assert shlex.split(command)[-1] == f'--out_dir={out}'  # pasted into a shell, it names the folder
    r = run(*shlex.split(command)[1:], '--max_iters=6')
    assert r.returncode == 0, r.stderr


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
destroy = torch.distributed.destroy_process_group
def probe():  # at its end, each rank writes down its weights and the batch it drew last
    run = sys._getframe(1).f_globals  # train.py's
    json.dump(dict(weights=[p.double().sum().item() for p in run['raw_model'].parameters()], batch=run['X'].tolist()),
              open(os.path.join(run['out_dir'], f"rank{run['rank']}.json"), 'w'))
    destroy()
torch.distributed.destroy_process_group = probe
sys.argv[0] = 'train.py'
runpy.run_path('train.py', run_name='__main__')
"""


def test_ddp_two_cpu_ranks_see_different_batches_and_end_identical(corpus, tmp_path):
    r = run('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '--no-python', sys.executable, '-c',
            DDP_PROBE, '--device=cpu', f'--data_dir={corpus}', f'--out_dir={tmp_path}', *SMALL, '--max_iters=6',
            '--eval_interval=3', '--attn=coupled')
    assert r.returncode == 0, r.stderr[-2000:]
    ranks = [json.load(open(tmp_path / f'rank{i}.json')) for i in range(2)]
    assert ranks[0]['weights'] == ranks[1]['weights'] and ranks[0]['batch'] != ranks[1]['batch']
    ranked = run('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', '--device=cpu',
                 f'--out_dir={tmp_path}', '--eval_only=True')  # evaluation alone, under torchrun
    assert ranked.returncode == 0, ranked.stderr[-2000:]
    assert '2 process(es)' in r.stdout
    single, resumed = scripts(('train.py', f'--out_dir={tmp_path}', '--eval_only=True'),
                              ('train.py', f'--out_dir={tmp_path}', '--init_from=resume', '--max_iters=8'))
    full = lambda out: float(re.search(r'full val split: loss ([\d.]+)', out).group(1))
    assert full(r.stdout) == full(ranked.stdout) == pytest.approx(full(single.stdout), abs=2e-4)  # shared windows
    # resumed as one process: the tokens count what was trained, 6 x 2 ranks, then 2 x 1
    assert resumed.returncode == 0, resumed.stderr
    assert 'note: the checkpoint was trained by 2 process(es), this run has 1: the batches continue in a new order' \
        in resumed.stdout  # said, not silent
    assert [m for m in metrics(tmp_path) if m['event'] == 'final'][-1]['tokens'] == (6 * 2 + 2) * 4 * 32


def test_compile_works_on_cpu(corpus, tmp_path):
    r = train(corpus, tmp_path, '--compile=True', '--max_iters=3', '--eval_interval=3', '--n_layer=1',
              '--attn=coupled', '--dtype=bfloat16', timeout=600)  # as the GPU recipe: bf16 autocast, compiled
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'compiling' in r.stdout and 'torch.compile failed' not in r.stdout
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
    if f and f.f_code.co_name == '<module>' and f.f_globals['iter_num'] in at:
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
    return d, [run(*call, patch=INJECT_NAN.replace('AT', repr(at))) for at, call in calls]


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
    assert math.isfinite([m for m in metrics(d / run) if m['event'] == 'final'][-1]['val_loss'])


def test_a_finished_run_resumed_to_train_longer_keeps_its_result_when_the_extension_stops(nan_runs, capsys,
                                                                                          monkeypatch):
    d, rs = nan_runs
    first, extension = rs[4:]
    assert first.returncode == 0 and extension.returncode == 3, extension.stderr
    assert one_line_error(extension, 'the last checkpoint is at iteration 6:')  # saved at 6 (eval), NaN at 6
    finals = [m for m in metrics(d / 'finished') if m['event'] == 'final']
    assert len(finals) == 1 and finals[0]['iter'] == 4  # the log is appended to, never rewritten
    code, out, err = bench_report(capsys, monkeypatch, f'--report={d / "finished"}')
    assert code == 0 and f"| {finals[0]['val_ppl']:.3f} |" in out, (out, err)  # the report shows that result


def test_mfu_is_in_the_log_line_where_the_peak_is_known(nan_runs):
    # on CUDA the peak comes from model.GPU_PEAK_FLOPS by the device's name; here a mocked peak stands in for it
    d, rs = nan_runs
    assert re.search(r'iter 4/4 \| .* \| mfu \d+\.\d%', rs[4].stdout), rs[4].stdout
    record = [m for m in metrics(d / 'finished') if m['event'] == 'train'][-1]
    want = flops_per_token(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=32, vocab_size=257), 32) * 4 * 32
    assert record['mfu'] == pytest.approx(want / (record['ms'] / 1000) / 1e12, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C: at any moment, one line and exit code 130

def wait_for(path, timeout=120):
    deadline = time.time() + timeout
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(path), f"{path} never appeared"


def stopped_cleanly(p, timeout=60):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 130, (p.returncode, out[-1000:], err[-2000:])
    assert 'Traceback' not in out + err and 'KeyboardInterrupt' not in out + err, err[-2000:]
    return out.strip().splitlines()[-1], err


@pytest.mark.parametrize('moment', ['import torch', 'setup', 'first eval'])
def test_ctrl_c_during_start_up_stops_with_one_line(corpus, tmp_path, moment):
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


@pytest.mark.parametrize('script', ['train.py', 'bench.py', 'prepare_data.py'])
def test_each_script_installs_its_ctrl_c_handler_before_its_first_slow_import(script):
    # a Ctrl-C 30 ms after the start lands in the imports: only os, signal and sys may come before the handler
    for node in ast.parse(open(os.path.join(HERE, script)).read()).body:
        if 'signal.signal(signal.SIGINT' in ast.unparse(node):
            break
        names = {a.name for a in node.names} if isinstance(node, (ast.Import, ast.ImportFrom)) else set()
        assert names <= {'os', 'signal', 'sys'}, f"{script} imports {names} before its Ctrl-C handler"
    else:
        raise AssertionError(f"{script} installs no Ctrl-C handler")


@pytest.mark.parametrize('script, module', [('bench.py', 'torch'), ('prepare_data.py', 'numpy')])
def test_ctrl_c_during_the_imports_of_bench_and_prepare_data(tmp_path, script, module):
    # a stand-in for the slow import (torch: seconds) that says when it has begun, so the signal lands inside it
    (tmp_path / module).mkdir()
    (tmp_path / module / '__init__.py').write_text(f"import time\nopen({str(tmp_path / 'began')!r}, 'w').close()\n"
                                                   "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, script, f'--report={tmp_path}' if script == 'bench.py' else '--help'],
                         cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    wait_for(tmp_path / 'began', timeout=30)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and out == '' and err.strip() in ('interrupted', 'interrupted: nothing was written')


def test_ctrl_c_stops_a_trainer_that_inherited_sigint_ignored(corpus, tmp_path):
    # a background job of a non-interactive shell (sh -c 'python train.py & wait') starts with SIGINT ignored
    p = start(*trains(corpus, tmp_path, '--max_iters=100000', '--eval_interval=5'), sigint_ignored=True)
    wait_for(tmp_path / 'ckpt.pt')
    p.send_signal(signal.SIGINT)
    last, _ = stopped_cleanly(p)
    assert last.startswith('interrupted at iteration') and '--init_from=resume' in last


SLOW_SAVE = """
import os, pathlib, signal, time, torch
save, replace, calls = torch.save, os.replace, [0]
def slow_save(*a, **k):
    calls[0] += 1
    if calls[0] == 2:  # the second checkpoint (iteration 10) takes a while
        pathlib.Path(FLAG).touch()
        time.sleep(4)
    return save(*a, **k)
def replace_then_ctrl_c(src, dst):  # RENAME: a second Ctrl-C right as the new checkpoint takes the old one's place
    replace(src, dst)
    if RENAME and calls[0] == 2:
        os.kill(os.getpid(), signal.SIGINT)
torch.save, os.replace = slow_save, replace_then_ctrl_c
"""


@pytest.mark.parametrize('presses', ['1', '2', '2, the second at the rename'])
def test_ctrl_c_during_a_checkpoint_write(corpus, tmp_path, presses):
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
        assert time.time() - t0 < 3 and ckpt['iter_num'] == 5 and 'last checkpoint is at iteration 5:' in last
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
def test_ctrl_c_during_an_evaluation_or_a_sample(corpus, tmp_path, when):
    out = tmp_path / 'out'
    if when != 'final evaluation':
        assert train(corpus, out, '--max_iters=2').returncode == 0
    flag = tmp_path / 'evaluating'
    patch = SLOW_EVAL.replace('FLAG', repr(str(flag)))
    if when == 'sample':
        patch = patch.replace('numpy.fromfile = slow_fromfile', 'import model\nmodel.GPT.generate = '
                              'lambda *a, **k: (pathlib.Path(FLAG).touch(), time.sleep(4))'.replace('FLAG', repr(str(flag))))
    extra = {'final evaluation': ['--max_iters=4', '--eval_interval=2'], 'eval_only': ['--eval_only=True'],
             'sample': ['--sample=The ']}[when]
    p = patched_train(corpus, out, patch, *extra, popen=True)
    wait_for(flag)
    p.send_signal(signal.SIGINT)
    last, _ = stopped_cleanly(p)
    if when == 'final evaluation':
        assert last == (f"interrupted during the final evaluation; the last checkpoint is at iteration 4: "
                        f"{out / 'ckpt.pt'}. Continue with: python train.py --init_from=resume --out_dir={out}")
        r = train(corpus, out, '--init_from=resume')  # which finishes the evaluation and logs the final record
        assert r.returncode == 0 and metrics(out)[-1]['event'] == 'final'
    else:
        assert last == 'interrupted; nothing was written'


# ---------------------------------------------------------------------------------------------------------------
# a run owns its out_dir; a full disk is one line

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


def test_two_trainers_never_share_an_out_dir_and_a_corpus_in_use_is_not_prepared_again(corpus, tmp_path):
    out, go = tmp_path / 'out', tmp_path / 'go'
    first = start(*trains(corpus, out, '--max_iters=60', '--eval_interval=50', '--seed=1'),
                  patch=HOLD.replace('GO', repr(str(go))))
    wait_for(tmp_path / 'go.waiting')  # training: its out_dir and its corpus are in use
    (tmp_path / 'other.txt').write_text(TEXT)
    try:
        refused = scripts(*[trains(corpus, out, *args) for args in (['--seed=2'], ['--init_from=resume'],
                                                                    ['--attn=coupled', '--seed=3'])],
                          ('prepare_data.py', f'--input={tmp_path / "other.txt"}', '--name=pydocs',
                           f'--data_dir={corpus}', '--force'))
        os.remove(out / 'train.lock')  # deleting that file defeats nothing: the folder itself is locked
        unlocked = run(*trains(corpus, out, '--seed=4'))
        assert first.poll() is None  # held: the refusals came while it trained
    finally:
        go.touch()  # whatever happened, the held run goes on
    for r in refused[:3]:
        assert one_line_error(r, 'is in use by a running train.py') and f'pid {first.pid}' in r.stderr, r.stderr
    assert one_line_error(refused[3], 'is being read by a running train.py'), refused[3].stderr
    assert one_line_error(unlocked, 'is in use by a running train.py'), unlocked.stderr
    out_, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-2000:]
    log = metrics(out)
    assert [m['config']['seed'] for m in log if m['event'] == 'start'] == [1]
    assert log[-1]['event'] == 'final' and [m['iter'] for m in log if m['event'] == 'eval'][:2] == [0, 50]
    assert f"({read_bin(os.path.join(corpus, 'pydocs', 'val.bin')).size:,} tokens)" in out_  # its corpus, unchanged
    assert json.load(open(os.path.join(corpus, 'pydocs', 'meta.json')))['corpus'] == 'pydocs'
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == log[-1]['iter'] and ckpt['config']['seed'] == 1 and ckpt['config']['attn'] == 'standard'
    # its checkpoint deleted, a new run in its folder: the finished run's log is kept, not truncated
    before = (out / 'metrics.jsonl').read_text()
    os.remove(out / 'ckpt.pt')
    new = train(corpus, out, '--max_iters=1', '--seed=5')
    assert new.returncode == 0 and f"kept as {out / 'metrics.jsonl.1'}" in new.stdout
    assert (out / 'metrics.jsonl.1').read_text() == before and metrics(out)[0]['config']['seed'] == 5
    # started at the same moment on an empty folder: one trains, the other is refused and touches nothing
    both = [start(*trains(corpus, tmp_path / 'new', '--max_iters=6', f'--seed={s}')) for s in (1, 2)]
    ends = [(p.communicate(timeout=240)[1], p.returncode) for p in both]
    assert sorted(code for err, code in ends) == [0, 2]
    err = [err for err, code in ends if code == 2][0].strip()
    assert err.startswith('error:') and ('is in use by a running train.py' in err or 'holds a run' in err), err
    seeds = [m['config']['seed'] for m in metrics(tmp_path / 'new') if m['event'] == 'start']
    assert len(seeds) == 1 and torch.load(tmp_path / 'new' / 'ckpt.pt', weights_only=True)['config']['seed'] == seeds[0]


def test_a_full_disk_while_saving_or_logging_is_one_line_and_the_last_checkpoint_survives(corpus, tmp_path):
    out = tmp_path / 'out'
    assert train(corpus, out, '--max_iters=4', '--eval_interval=2').returncode == 0
    before = (out / 'ckpt.pt').read_bytes()
    r = train(corpus, out, '--init_from=resume', '--max_iters=8', fsize=200_000)  # ckpt: megabytes
    assert r.returncode == 1 and one_line_error(r, 'cannot write') and 'ckpt.pt' in r.stderr, r.stderr
    assert 'nothing else was touched' in r.stderr and 'the last checkpoint is at iteration 4:' in r.stderr
    assert (out / 'ckpt.pt').read_bytes() == before and not (out / 'ckpt.pt.tmp').exists()
    # the log: a full disk mid-line leaves whole lines only, and says so in one line
    r = train(corpus, tmp_path / 'log', '--max_iters=200', '--eval_interval=1000', fsize=4000)
    assert r.returncode == 1 and one_line_error(r, 'metrics.jsonl') and 'no checkpoint yet' in r.stderr
    text = (tmp_path / 'log' / 'metrics.jsonl').read_text()
    assert text.endswith('\n') and all(json.loads(line) for line in text.splitlines())


# ---------------------------------------------------------------------------------------------------------------
# bench.py --report: rows of comparable runs, the tokens standard needs, curves

def fake_run(folder, evals, final_ppl, world_size=1, fingerprint=None, model_iter=None, **config):
    """A finished run's metrics.jsonl: a start record, evals [(tokens, val_loss)], a final record (128 tokens an
    iteration); final_ppl=None: no final (the run stopped). fingerprint: its corpus's (None: an older run's log);
    model_iter: the iteration of the model the final scored (a best-only checkpoint's)."""
    cfg = dict(dataset='pydocs', attn='standard', n_layer=2, n_head=4, n_embd=128, block_size=32, bias=False,
               pos='learned', batch_size=4, gradient_accumulation_steps=1, eval_iters=2, learning_rate=1e-3,
               max_iters=evals[-1][0] // 128, seed=1) | config
    os.makedirs(folder)
    log_records(folder, dict(event='start', iter=0, config=cfg, world_size=world_size, tokens=0)
                | ({'fingerprint': fingerprint} if fingerprint else {}))
    log_evals(folder, evals, final_ppl, model_iter)
    return cfg


def log_evals(folder, evals, final_ppl=None, model_iter=None):
    log_records(folder, *[dict(event='eval', iter=t // 128, tokens=t, val_loss=loss, qk=[]) for t, loss in evals])
    if final_ppl is not None:
        log_records(folder, dict(event='final', iter=evals[-1][0] // 128, tokens=evals[-1][0],
                                 val_loss=math.log(final_ppl), val_ppl=final_ppl)
                    | (dict(model_iter=model_iter, model_tokens=model_iter * 128) if model_iter is not None else {}))


def log_records(folder, *records):
    with open(os.path.join(folder, 'metrics.jsonl'), 'a') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)


def resume_run(folder, cfg, at, evals, final_ppl=None, world_size=1, **changes):
    """Append a resume from the checkpoint at iteration `at` to a fake run's log: train.py appends a start record,
    then what it trains; changes: flags given at the resume."""
    log_records(folder, dict(event='start', iter=at, config=cfg | changes, world_size=world_size, tokens=at * 128))
    log_evals(folder, evals, final_ppl)


def bench_report(capsys, monkeypatch, *args):
    """bench.py --report... in this process (a subprocess would pay torch's import): (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, 'argv', ['bench.py', *args])
    try:
        bench.main()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit('error: ...'): Python prints the line and exits with 1
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    out = capsys.readouterr()
    return code, out.out, out.err


def report_rows(stdout):
    return {row.split(' | ')[1]: row.split(' | ') for row in stdout.splitlines() if row.startswith('| pydocs')}


def test_report_reads_the_tokens_standard_needs_off_its_curves(tmp_path):
    curve = [(0, 5.0), (128, 4.0), (256, 3.0), (384, 2.5), (512, 2.0)]
    for s in (1, 2):  # standard: two seeds whose mean is the curve above
        fake_run(tmp_path / f'standard-s{s}', [(t, v + (0.1 if s == 1 else -0.1)) for t, v in curve], 8.0, seed=s)
    fake_run(tmp_path / 'standard-2.4x-s1', [(int(t * 2.4) // 128 * 128, v - 0.4) for t, v in curve], 7.0,
             max_iters=9)  # a longer standard run: its curve reaches further
    fake_run(tmp_path / 'coupled-s1', [(0, 5.0), (256, 3.2), (512, 2.9)], 9.0, attn='coupled')
    fake_run(tmp_path / 'uncoupled-s1', [(0, 5.0), (256, 3.0), (512, 1.0)], 6.0, attn='uncoupled')
    r = run('bench.py', f'--report={tmp_path}')
    assert r.returncode == 0, r.stderr
    rows = report_rows(r.stdout)
    # read off the longest standard run, standard-2.4x: (0, 4.6), (256, 3.6), (512, 2.6), (896, 2.1), (1152, 1.6)
    assert rows['coupled'][5] == '0.85x'  # 2.9 is reached 0.7 of the way from 256 to 512: 435.2 tokens, / 512
    assert rows['standard'][5] == '1.85x'  # 2.0 (mean of 2.1, 1.9): 947.2 tokens; a long run's mid-run points
    assert rows['uncoupled'][5] == '> 2.25x'  # 1.0: never, the curve ends at 1152 tokens
    assert rows['standard-2.4x'][4] == '-12.5% at 2.25x its tokens'  # different tokens: never compared silently
    assert 'reads the curve of standard-2.4x (1 seed, 5 evals to 1,152 tokens)' in r.stdout


def test_report_splits_a_label_whose_runs_differ_and_skips_what_is_not_a_record(corpus, tmp_path):
    curve = [(0, 5.0), (128, 3.0)]
    fake_run(tmp_path / 'standard-s1', curve, 8.0, n_layer=2, seed=1)
    fake_run(tmp_path / 'standard-s3', curve, 9.0, n_layer=1, seed=3)  # another model under the same label
    fake_run(tmp_path / 'coupled-s1', curve, 8.5, attn='coupled', n_layer=2)
    fake_run(tmp_path / 'diff-s1', curve, 8.5, attn='diff', n_layer=2)
    with open(tmp_path / 'coupled-s1' / 'metrics.jsonl', 'a') as f:
        f.write('[1, 2]\nnull\n"text"\n{"event": "train", "it')  # valid JSON that is not a record; a cut line
    lines = open(tmp_path / 'diff-s1' / 'metrics.jsonl').read().splitlines()
    (tmp_path / 'diff-s1' / 'metrics.jsonl').write_text('\n'.join(lines[:-1] + ['{"event": "final", "iter": 1}']))
    r = run('bench.py', f'--report={tmp_path}')
    assert r.returncode == 0, r.stderr
    rows = report_rows(r.stdout)
    assert set(rows) == {'standard [n_layer=1]', 'standard [n_layer=2]', 'coupled'}
    assert rows['coupled'][4] == '+6.2%'  # against the standard of its own shape
    assert 'pydocs/standard: its runs are not all alike (n_layer differ); shown as 2 rows' in r.stderr
    assert r.stderr.count('is not a log record') == 4 and "diff-s1/metrics.jsonl is not a finished run" in r.stderr


def test_report_plot_draws_the_curves_or_says_how_to_get_them(tmp_path, capsys, monkeypatch):
    fake_run(tmp_path / 'runs' / 'standard-s1', [(0, 5.0), (128, 3.0), (256, 2.5)], 8.0)
    fake_run(tmp_path / 'runs' / 'coupled-s1', [(0, 5.0), (128, 3.1), (256, 2.4)], 8.0, attn='coupled')
    with monkeypatch.context() as m:
        m.setitem(sys.modules, 'matplotlib', None)  # not installed
        code, out, err = bench_report(capsys, monkeypatch, f'--report={tmp_path / "runs"}',
                                      f'--plot={tmp_path / "c.png"}')
    assert code == 1 and out == '' and err.strip() == (
        "error: --plot needs matplotlib (pip install matplotlib); without --plot, the table needs nothing")
    pytest.importorskip('matplotlib')
    code, out, err = bench_report(capsys, monkeypatch, f'--report={tmp_path / "runs"}', f'--plot={tmp_path / "c.png"}')
    assert code == 0 and (tmp_path / 'c.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.parametrize('plot, words', [('missing/c.png', 'No such file or directory'),
                                         ('c.xyz', "Format 'xyz' is not supported (supported formats: "),
                                         ('c', 'a file named by its format')])
def test_report_plot_path_is_checked_before_any_work(tmp_path, capsys, monkeypatch, plot, words):
    pytest.importorskip('matplotlib')
    fake_run(tmp_path / 'runs' / 'standard-s1', [(0, 5.0), (128, 3.0)], 8.0)
    code, out, err = bench_report(capsys, monkeypatch, f'--report={tmp_path / "runs"}', f'--plot={tmp_path / plot}')
    assert code == 1 and out == '' and words in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(tmp_path) == ['runs']


def test_report_a_run_resumed_with_other_settings_is_its_own_row(tmp_path, capsys, monkeypatch):
    runs = tmp_path / 'runs'
    for s in (1, 2):  # straight runs of 4 and 8 iterations
        fake_run(runs / f'coupled-4-s{s}', [(0, 5.0), (256, 3.5), (512, 3.0)], 9.0 + s, attn='coupled', seed=s)
        fake_run(runs / f'coupled-8-s{s}', [(0, 5.0), (512, 3.0), (1024, 2.5)], 7.0 + s, attn='coupled', seed=s)
    # coupled-4-s3 finished 4 iterations, was resumed with --max_iters=8, and that extension stopped (no final)
    cfg = fake_run(runs / 'coupled-4-s3', [(0, 5.0), (256, 3.5), (512, 3.2)], 10.5, attn='coupled', seed=3)
    resume_run(runs / 'coupled-4-s3', cfg, 4, [(512, 3.2), (768, 0.1)], max_iters=8)
    # coupled-8-s3: the same, and the extension finished: its schedule jumped at iteration 4
    cfg = fake_run(runs / 'coupled-8-s3', [(0, 5.0), (256, 3.5), (512, 3.2)], 10.5, attn='coupled', seed=3)
    resume_run(runs / 'coupled-8-s3', cfg, 4, [(512, 3.2), (1024, 2.4)], 7.5, max_iters=8)
    # coupled-8-s4: killed after an eval at iteration 6, past its checkpoint at 5, resumed from 5 (the eval at 6
    # is superseded), killed again, then resumed from 6 as 1 process instead of 2: its own row
    cfg = fake_run(runs / 'coupled-8-s4', [(0, 5.0), (640, 2.9), (768, 0.1)], None, attn='coupled', seed=4,
                   max_iters=8, world_size=2)
    resume_run(runs / 'coupled-8-s4', cfg, 5, [(768, 2.8)], world_size=2)
    resume_run(runs / 'coupled-8-s4', cfg, 6, [(1024, 2.6)], 8.6, world_size=1)
    code, out, err = bench_report(capsys, monkeypatch, f'--report={runs}')
    assert code == 0, err
    rows = report_rows(out)
    assert set(rows) == {'coupled-4', 'coupled-8', 'coupled-8 [resumed: max_iters 4->8]',
                         'coupled-8 [resumed: world_size 2->1]'}, out
    assert rows['coupled-4'][2] == '3' and rows['coupled-4'][3] == '10.500 +- 0.500'  # s3: its result at 4 kept
    assert rows['coupled-8'][2] == '2' and rows['coupled-8 [resumed: max_iters 4->8]'][3] == '7.500'
    assert 'coupled-8-s3/metrics.jsonl: resumed with other settings; a row of its own' in err
    loaded = {os.path.basename(os.path.dirname(r['path'])): r for r in bench.load_runs([str(runs)])}
    assert [e['tokens'] for e in loaded['coupled-4-s3']['evals']] == [0, 256, 512]  # none past its final
    assert [(e['tokens'], e['val_loss']) for e in loaded['coupled-8-s4']['evals']] == [
        (0, 5.0), (640, 2.9), (768, 2.8), (1024, 2.6)]  # the records past a checkpoint are gone
    assert loaded['coupled-4-s3']['config']['max_iters'] == 4


def test_report_counts_each_run_once(tmp_path, capsys, monkeypatch):
    runs = tmp_path / 'runs'
    fake_run(runs / 'standard-s1', [(0, 5.0), (128, 3.0)], 8.0)
    fake_run(runs / 'coupled-s1', [(0, 5.0), (128, 3.0)], 8.0, attn='coupled')
    fake_run(runs / 'out-coupled-s1', [(0, 5.0), (128, 3.0)], 8.2, attn='coupled')  # seed 1 again
    fake_run(runs / 'coupled-s2', [(0, 5.0), (128, 3.0)], 9.0, attn='coupled', seed=2)
    os.symlink(runs, runs / 'coupled-s1' / 'loop')  # a symlink loop
    os.symlink(runs / 'coupled-s2', tmp_path / 'latest')  # a run reached twice
    code, out, err = bench_report(capsys, monkeypatch, f'--report={runs},{runs}/.,{tmp_path / "latest"}')
    assert code == 0, err
    rows = report_rows(out)
    assert rows['coupled'][2] == '2' and rows['coupled'][3] == '8.550 +- 0.636'  # seeds 1 (8.0, 8.2) and 2 (9.0)
    assert rows['standard'][2] == '1' and 'pydocs/coupled: 2 runs share seed 1' in err


def test_report_never_averages_two_corpora_and_says_which_model_and_run_it_reads(tmp_path, capsys, monkeypatch):
    runs, a, b = tmp_path / 'runs', 'a' * 64, 'b' * 64
    fake_run(runs / 'standard-s1', [(0, 5.0), (128, 3.0)], 8.0, fingerprint=a)
    fake_run(runs / 'coupled-s1', [(0, 5.0), (128, 3.0)], 8.0, attn='coupled', fingerprint=a)
    fake_run(runs / 'coupled-s2', [(0, 5.0), (128, 3.0)], 9.0, attn='coupled', seed=2, fingerprint=b)  # re-prepared
    os.makedirs(runs / 'coupled-s3')
    os.symlink(runs / 'coupled-s1' / 'metrics.jsonl', runs / 'coupled-s3' / 'metrics.jsonl')  # s1's log, linked
    # best-only: the final scored the checkpoint of iteration 1 of 2; an extension from it then stopped
    cfg = fake_run(runs / 'best-s1', [(0, 5.0), (128, 3.0), (256, 3.5)], 7.0, model_iter=1)
    resume_run(runs / 'best-s1', cfg, 1, [(256, 3.4)], max_iters=9)
    # a finished run resumed with only --seed=2 (nothing trained): still seed 1, beside a seed 2
    cfg = fake_run(runs / 'rerun-s1', [(0, 5.0), (128, 3.0)], 8.0)
    resume_run(runs / 'rerun-s1', cfg, 1, [(128, 3.0)], 8.0, seed=2)
    fake_run(runs / 'rerun-s2', [(0, 5.0), (128, 3.0)], 9.0, seed=2)
    lines = open(runs / 'rerun-s2' / 'metrics.jsonl').readlines()  # a log whose lines were shuffled
    fake_run(runs / 'shuffled-s1', [(0, 5.0)], 1.0)
    (runs / 'shuffled-s1' / 'metrics.jsonl').write_text(''.join(lines[:1] + lines[:0:-1]))
    code, out, err = bench_report(capsys, monkeypatch, f'--report={runs}')
    assert code == 0, err
    rows = report_rows(out)
    assert set(rows) == {'standard', f'coupled [fingerprint={a[:12]}]', f'coupled [fingerprint={b[:12]}]', 'best',
                         'rerun'}, out
    assert rows[f'coupled [fingerprint={a[:12]}]'][2:5] == ['1', '8.000', '+0.0%']  # s3 is s1: counted once
    assert rows[f'coupled [fingerprint={b[:12]}]'][2:5] == ['1', '9.000', '-']  # no standard ran on that text
    assert 'pydocs/coupled: its runs trained on different texts under the name pydocs' in err
    assert 'coupled-s1/metrics.jsonl and ' in err and 'are one file (a link); counted once' in err
    assert rows['best'][3] == '7.000' and rows['best'][8] == '128'  # the checkpoint's model, at its tokens
    assert "best-s1/metrics.jsonl: its result is its best-only checkpoint's model, iteration 1 of 2" in err
    assert rows['rerun'][2:4] == ['2', '8.500 +- 0.707'] and 'share seed' not in err
    assert 'shuffled-s1/metrics.jsonl: its records are out of order' in err
    # runs logged before corpora had fingerprints: one row, as before
    code, out, err = bench_report(capsys, monkeypatch, f'--report={runs / "rerun-s1"},{runs / "rerun-s2"}')
    assert code == 0 and set(report_rows(out)) == {'rerun'} and err == ''


BAD_RECORDS = {  # what a broken or hand-edited log may hold; each record is skipped with a warning
    'qk a string': [dict(event='eval', iter=1, tokens=128, val_loss=3.0, qk='none')],
    'qk malformed': [dict(event='eval', iter=1, tokens=128, val_loss=3.0, qk=[{'nonlinear': 'high'}])],
    'dt a string': [dict(event='eval', iter=1, tokens=128, val_loss=3.0, qk=[{'nonlinear': 0.1, 'dt': 'small'}])],
    'wrong types': [dict(event='eval', iter=1, tokens='many', val_loss=3.0), dict(event='train', iter='one', ms=5),
                    dict(event='train', iter=1, ms=[5]), dict(event='start', iter=1, config='fast'),
                    dict(event='final', iter=1, tokens=128, val_loss=None, val_ppl=True)],
}


@pytest.mark.parametrize('case, words', [
    ('0 iterations', 'zero-s1/metrics.jsonl is not a finished run (no final val_ppl, val_loss, tokens > 0)'),
    ('a folder', 'folder/metrics.jsonl: Is a directory; left out'), ('a diverged seed', ''),
    *[(case, 'is not a log record') for case in BAD_RECORDS]])
def test_report_bad_inputs_are_one_line_each(tmp_path, capsys, monkeypatch, case, words):
    runs = tmp_path / 'runs'
    fake_run(runs / 'standard-s1', [(0, 5.0), (128, 3.0)], 8.0)
    fake_run(runs / 'coupled-s1', [(0, 5.0), (128, 3.0)], 8.0, attn='coupled')
    if case == '0 iterations':  # --max_iters=0
        fake_run(runs / 'zero-s1', [(0, 5.0)], 150.0)
    elif case == 'a folder':  # where the log should be
        (runs / 'folder' / 'metrics.jsonl').mkdir(parents=True)
    elif case == 'a diverged seed':  # train.py reports an infinite perplexity
        fake_run(runs / 'coupled-s2', [(0, 5.0), (128, 3.0)], math.inf, attn='coupled', seed=2)
    else:
        log_records(runs / 'coupled-s1', *BAD_RECORDS[case])
    code, out, err = bench_report(capsys, monkeypatch, f'--report={runs}')
    assert code == 0 and set(report_rows(out)) == {'standard', 'coupled'}, err
    assert err.count('\n') == len(BAD_RECORDS.get(case, [words] * bool(words))) and words in err, err
    if case == '0 iterations':  # and alone
        code, out, err = bench_report(capsys, monkeypatch, f'--report={runs / "zero-s1"}')
        assert code == 1 and out == '' and err.count('\n') == 2 and 'error: no finished train.py runs' in err
    if case == 'a diverged seed':
        assert report_rows(out)['coupled'][3] == 'inf'


def test_gpu_check_runs_at_a_reduced_shape_on_cpu(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, 'compile', lambda model, **kw: model)  # compiling: test_compile_works_on_cpu
    monkeypatch.setattr(subprocess, 'run', lambda cmd: run(*cmd[1:]))  # its `python train.py ...` runs, forked
    r = subprocess.CompletedProcess('bench.py', *bench_report(
        capsys, monkeypatch, '--gpu_check', '--device=cpu', '--dtype=float32', '--preset=tiny', '--batch_size=2', '--block_size=32',
        '--vocab_size=257', '--iters=1', '--warmup=0', '--train_iters=4', '--train_compile=False', '--eval_iters=2',
        f'--data_dir={corpus}', f'--out={tmp_path}'))
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r'eager \d\.\d{3}, compiled \d\.\d{3}', r.stdout)
    for row in ('ms/iter', 'tokens/s', 'MFU', 'val loss (full split)'):
        assert re.search(rf'^\| {re.escape(row)} \| ', r.stdout, re.M), row
    runs = [d for d in os.listdir(tmp_path)]
    assert len(runs) == 1 and all(metrics(tmp_path / runs[0] / a)[-1]['event'] == 'final'
                                  for a in ('standard', 'coupled'))


# ---------------------------------------------------------------------------------------------------------------
# the README's one-GPU recipe: every command's code path, on CPU, at a reduced shape

def gpu_recipe():
    """The README's recipe: the command R and each run's (name, flags after $R)."""
    ladder = readme_section('The ladder')
    return re.search(r'^R="(.*)"$', ladder, re.M).group(1), re.findall(r'^\| (\S+) \| `\$R (.*?)` \|', ladder, re.M)


def test_readme_gpu_recipe_is_what_bench_plan_prints(capsys, monkeypatch):
    r = subprocess.CompletedProcess('bench.py', *bench_report(capsys, monkeypatch, '--plan'))
    assert r.returncode == 0, r.stderr
    ladder = readme_section('The ladder')
    assert all(line in ladder for line in r.stdout.splitlines())  # the README shows bench.py's recipe, as printed
    names = [name for name, flags in gpu_recipe()[1]]
    assert names == ['standard', 'coupled', 'euler', 'uncoupled', 'coupled-steps7', 'invertible', 'diff',
                     'diff+coupled', 'standard-2.4x']


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
    # a prompt that is not UTF-8 (a shell passes bytes): its bytes, printed with replacement characters
    r = run('train.py', f'--out_dir={b}', b'--sample=\xff\xfe def', '--sample_tokens=8')
    assert r.returncode == 0 and "after '\ufffd\ufffd def'" in r.stdout, r.stderr[-2000:]


REDUCED = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=1',
           '--gradient_accumulation_steps=2', '--max_iters=2', '--eval_interval=2', '--eval_iters=1',
           '--warmup_iters=1', '--compile=False', '--device=cpu', '--sample_tokens=0']  # compile: its own test


def test_every_gpu_recipe_command_runs_at_a_reduced_shape_and_tabulates(wikitext103, tmp_path, capsys, monkeypatch):
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
        final = metrics(tmp_path / 'runs' / '60m' / name)[-1]
        assert final['event'] == 'final' and all(math.isfinite(final[k]) for k in ('val_ppl', 'test_ppl', 'val_bpb'))
    r = subprocess.CompletedProcess('bench.py', *bench_report(capsys, monkeypatch, f'--report={tmp_path / "runs" / "60m"}'))
    assert r.returncode == 0, r.stderr
    assert all(f'| wikitext103 | {name} | 1 |' in r.stdout for name, flags in rows), r.stdout


# ---------------------------------------------------------------------------------------------------------------
# bench.py: records, not timings (timings are never asserted)

def test_bench_writes_one_record_per_variant_and_mode(tmp_path, capsys, monkeypatch):
    out = tmp_path / 'bench.jsonl'
    r = subprocess.CompletedProcess('bench.py', *bench_report(
        capsys, monkeypatch, '--preset=tiny', '--attn=coupled,diff+coupled', '--vocab_size=64', '--batch_size=2',
        '--block_size=16', '--new_tokens=4', '--iters=1', '--warmup=0', f'--json_out={out}'))
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
    (['--iters=0'], '--iters'), (['--block_size=-4'], '--block_size'), (['--batch_size=0'], '--batch_size'),
    (['--new_tokens=0'], '--new_tokens'), (['--warmup=-1'], '--warmup'),
    (['--json_out=/nonexistent/dir/b.jsonl'], 'json_out'), (['--device=tpu'], 'unknown'),
    (['--plot=c.png'], '--report'), (['--report='], 'names an empty folder'), (['--report=runs,'], 'empty folder'),
    (['--attn=coupled', '--qk_steps=8'], 'qk_steps must be in 1..7'), (['--qk_hidden=0'], 'qk_hidden must be'),
])
def test_bench_bad_flags_give_one_clear_line(args, words, capsys, monkeypatch):
    r = subprocess.CompletedProcess('bench.py', *bench_report(capsys, monkeypatch, *args))
    assert one_line_error(r, words)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason='MPS is available here')
def test_bench_on_mps_off_a_mac_is_one_line(capsys, monkeypatch):
    r = subprocess.CompletedProcess('bench.py', *bench_report(capsys, monkeypatch, '--device=mps'))
    assert one_line_error(r, 'MPS is not available')


def test_report_tabulates_any_run_folders_and_survives_a_cut_line(corpus, tmp_path, capsys, monkeypatch):
    for r in scripts(*[trains(corpus, tmp_path / name, '--max_iters=2', '--eval_interval=1', f'--attn={attn}')
                       for name, attn in (('out-standard', 'standard'), ('out-coupled', 'coupled'))]):
        assert r.returncode == 0, r.stderr
    with open(tmp_path / 'out-coupled' / 'metrics.jsonl', 'a') as f:
        f.write('{"event": "train", "it')  # a run killed while writing
    r = subprocess.CompletedProcess('bench.py', *bench_report(capsys, monkeypatch,
                                                             f'--report={tmp_path / "out-standard"},{tmp_path / "out-coupled"}'))
    assert r.returncode == 0, r.stderr
    assert 'out-coupled/metrics.jsonl:' in r.stderr and 'skipped' in r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith('| ') and 'variant' not in line]
    assert len(rows) == 2 and any('| coupled |' in row for row in rows) and any('| standard |' in row for row in rows)


# ---------------------------------------------------------------------------------------------------------------
# the README's classroom exercises: run as written, and held to the numbers they state

def readme_section(title, text=None):
    text = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read() if text is None else text
    return text.split(f'\n## {title}\n')[1].split('\n## ')[0]


def exercises(text=None):
    """{number: (title, body)} of the numbered exercises; the discussion after them is not one."""
    found = re.findall(r'\n\*\*(\d+)\. (.*?)\*\*(.*?)(?=\n\*\*\d+\. |\n\*\*Discussion|\Z)',
                       readme_section('Classroom exercises', text), re.S)
    return {int(n): (title, body) for n, title, body in found}


def snippet(body):
    return re.findall(r'```python\n(.*?)```', body, re.S)[0]


# the snippets a student runs as they are (one that adds to model.py is not), and the variants the tests run:
# without matplotlib (one line says how to get the picture), exercise 3 with k_i . k_j dropped from its formula
EXERCISES = [snippet(body) for _, body in exercises().values() if 'from model import' in snippet(body)]
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None\n"
BROKEN_FORMULA = ('scores(k, k) + ', '')
VARIANTS = [*EXERCISES, *(NO_MATPLOTLIB + code for code in EXERCISES if 'savefig' in code),
            *(code.replace(*BROKEN_FORMULA) for code in EXERCISES if BROKEN_FORMULA[0] in code)]

@pytest.fixture(scope='module')
def classroom(corpus, tmp_path_factory):
    """A folder laid out like the repository after the quick start: model.py, data/pydocs, a coupled run in out/."""
    d = tmp_path_factory.mktemp('classroom')
    os.makedirs(d / 'data')
    os.symlink(os.path.join(corpus, 'pydocs'), d / 'data' / 'pydocs')
    os.symlink(os.path.join(HERE, 'model.py'), d / 'model.py')  # a snippet saved in the repository root
    return d


@pytest.fixture(scope='module')
def printed(classroom, corpus):
    """{snippet: (what it printed, its traceback or '')} for every one of VARIANTS, each run once per session: those
    that read the quick start's run after training one (in the classroom), the others meanwhile."""
    def run_all(codes):  # each as `python -c snippet` in the classroom: a process of its own
        return {code: (r.stdout, r.stderr if r.returncode else '') for code in codes
                for r in [run('-c', code, cwd=classroom, timeout=300)]}

    def after_the_quick_start(codes):
        assert train(corpus, classroom / 'out', '--attn=coupled', '--max_iters=20', '--eval_interval=20',
                     '--block_size=128').returncode == 0  # the quick start's shape
        return run_all(codes)
    trained = [code for code in VARIANTS if 'out/ckpt.pt' in code]
    with ThreadPoolExecutor(2) as pool:  # two cores: training, and the snippets that need none
        jobs = [pool.submit(run_all, [c for c in VARIANTS if c not in trained]),
                pool.submit(after_the_quick_start, trained)]
        return {**jobs[0].result(), **jobs[1].result()}


def test_every_exercise_states_its_cost_asks_and_answers_and_the_lab_is_laid_out():
    section, numbered = readme_section('Classroom exercises'), exercises()
    assert len(numbered) >= 6 and list(numbered) == list(range(1, len(numbered) + 1))
    costs = [re.search(r'\((no training|one run|two runs|several runs)', title + body) for title, body in
             numbered.values()]
    assert all(costs) and sum(c.group(1) == 'no training' for c in costs) >= 4
    assert all('Look for' in body and re.search(r'\d', body.split('Look for')[1]) for _, body in numbered.values())
    fold = r'<details><summary>{}.*?</summary>\n\n.{{100,}}?</details>'
    for title, body in numbered.values():  # a worked answer, or where students train, how to judge theirs
        assert re.search(fold.format('For the lecturer' if 'several runs' in title else 'Answer'), body, re.S), title
    assert re.search(r'\n\*\*Discussion\.\*\* .*?\?\n\n' + fold.format('For the lecturer'), section, re.S)
    assert sum(bool(re.search(r'\*Predict\s+first\*', body)) for _, body in numbered.values()) >= 5
    assert len(EXERCISES) == len(numbered) - 1  # one snippet each, exercise 6's goes into model.py
    lab = section.split('\n**1. ')[0]  # the opening: start the long run first, then the time each exercise takes
    assert 'Start the quick start now' in lab and 'Minutes:' in lab
    readme = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read()
    assert readme.index('\n## Glossary\n') < readme.index('\n## Classroom exercises\n')  # words before their use
    # exercise 6 trains in the results' protocol, so its rows compare with the table's
    protocol = lambda text: re.search(r'\nP="(.*?)"\n', text).group(1)
    assert protocol(numbered[6][1]) == protocol(readme_section('Results at laptop scale'))


def test_each_script_is_a_file_a_reader_can_hold():
    budgets = {'train.py': 29_800, 'model.py': 28_500, 'bench.py': 35_500, 'prepare_data.py': 29_000}
    for name, chars in budgets.items():
        text = open(os.path.join(HERE, name), encoding='utf-8').read()
        assert len(text) <= chars and max(map(len, text.splitlines())) <= 120, name  # characters, not lines
    imports = re.findall(r'^(?:from|import) (\w+)', open(os.path.join(HERE, 'train.py')).read(), re.M)
    assert {'model', 'prepare_data'} <= set(imports) and not {'bench', 'test_model'} & set(imports)


def test_readme_is_a_page_a_newcomer_reads_and_its_pictures_exist():
    text = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read()
    assert len(text) <= 30_500  # characters, not lines: a line is not packed to save one
    assert '\u27e8' not in text and '{' + 'EX' not in text  # no placeholder left where a number belongs
    pictures = re.findall(r'!\[[^]]*\]\((\.assets/[^)]+)\)', text)
    assert len(pictures) >= 3 and all(os.path.exists(os.path.join(HERE, p)) for p in pictures), pictures
    assert '..' + '/shared' not in text  # a clone has no such folder


@pytest.mark.parametrize('i', range(len(EXERCISES)))
def test_readme_exercise_runs_as_written(printed, classroom, i):
    out, error = printed[EXERCISES[i]]
    assert error == '', error[-2000:]
    assert out.strip() and not re.search(r'\bnan\b', out.lower())
    picture = re.search(r"savefig\('(\w+\.png)'", EXERCISES[i])
    if picture:  # drawn where matplotlib is installed; otherwise one line says how to get it
        try:
            import matplotlib  # noqa: F401
            assert (classroom / picture.group(1)).exists()
        except ImportError:
            pass
        out, error = printed[NO_MATPLOTLIB + EXERCISES[i]]
        assert error == '' and out.strip().splitlines()[-1] == 'for the picture: pip install matplotlib'


# Exercises 1-4 (no training) are held to their numbers. What each number of an exercise's "Look for" paragraph
# is, in order, computed from what its snippet printed: (the value, or values that must all agree, and how close).
# A number in backticks is code, not a figure. How close the README must be (TOLERANCE):
#   digits:   a printed figure, to the digits the README gives (half a unit in its last place);
#   power2:   a growth factor the README rounds to a power of 2 ("4x"), within a quarter of a power of 2;
#   order:    the order p of that factor 2^p ("order 2"), within 0.25;
#   roundoff: a rounding error (it differs between machines), within a factor of 10.
def figures(out, pattern):
    rows = re.findall(pattern, out)
    assert rows, f"the output has no line like {pattern!r}:\n{out}"
    return rows


def exercise_1_figures(out):
    e = {(name, float(dt)): float(err) for name, dt, err in
         figures(out, r'(\w+) +dt=([\d.]+): largest energy error (\S+)')}
    leap, euler = (e[name, 0.1] / e[name, 0.05] for name in ('leapfrog', 'euler'))
    return [(e['leapfrog', 0.1], 'digits'), (e['leapfrog', 0.05], 'digits'), (leap, 'power2'), (leap, 'order'),
            (e['euler', 0.1], 'digits'), (e['euler', 0.05], 'digits'), (euler, 'power2'), (euler, 'order')]


def exercise_2_rows(out):  # {(integrator, dtype): (moved, back, det J min, max, singular values min, max, |..|)}
    number = r'([-+\d.e]+)'
    return {(name, dtype): [float(x) for x in row] for name, dtype, *row in figures(out, (
        rf'(\w+) (float\d+): moved {number}, back to {number}; det J {number} to {number}; singular values {number} '
        rf'to {number}; \|J\^T Omega J - Omega\| {number}'))}


def exercise_2_figures(out):
    r = exercise_2_rows(out)
    l32, l64, eu = r['leapfrog', 'float32'], r['leapfrog', 'float64'], r['euler', 'float64']
    return [((l32[0], l64[0]), 'digits'), (l32[1], 'roundoff'), (l64[1], 'roundoff'),
            ((*l32[2:4], *l64[2:4]), 'digits'), (l64[6], 'roundoff'), ((l32[5], l64[5]), 'digits'),
            ((l32[4], l64[4]), 'digits'), (eu[1], 'digits'), (eu[2], 'digits'), (eu[3], 'digits'), (eu[6], 'digits')]


def exercise_3_rows(out):  # [(dt, the scores' change, the formula's error, Euler's difference)]
    return [tuple(map(float, row)) for row in figures(
        out, r'dt=([\d.]+): scores change by (\S+); off by (\S+) \(the formula\), (\S+) \(Euler\)')]


def exercise_3_figures(out):
    rows = exercise_3_rows(out)
    return [(row[column], 'digits') for column in (1, 2, 3) for row in rows]


def exercise_4_rows(out):  # [(spread, nonlinear fraction, growth factor over the last spread or None)]
    return [(float(s), float(f), float(g) if g else None) for s, f, g in
            figures(out, r'spread ([\d.]+): nonlinear (\S+?)(?:, ([\d.]+)x the last)?\n')]


def exercise_4_figures(out):
    rows = exercise_4_rows(out)
    spread = {s: f for s, f, _ in rows}
    return [(rows[0][1], 'digits'), *[(g, 'digits') for _, _, g in rows[1:]], (spread[2.0], 'digits')]


LOOK_FOR = {1: exercise_1_figures, 2: exercise_2_figures, 3: exercise_3_figures, 4: exercise_4_figures}
NUMBER = re.compile(r'(?<![\w.^])\d+(?:\.\d+)?(?:e[-+]\d+)?')


def stated(paragraph):
    """The numbers a paragraph states outside `code`: [(start, end, text)], positions in the paragraph."""
    prose = re.sub(r'`[^`]*`', lambda m: ' ' * len(m.group()), paragraph)
    return [(m.start(), m.end(), m.group()) for m in NUMBER.finditer(prose)]


def close(text, value, how):
    x = float(text)
    if how == 'digits':
        mantissa, _, exponent = text.partition('e')
        decimals = len(mantissa.partition('.')[2])
        return abs(x - value) <= 0.5 * 10.0 ** (int(exponent or 0) - decimals) * (1 + 1e-9)
    if how == 'power2':
        return abs(math.log2(x) - math.log2(value)) <= 0.25
    if how == 'order':
        return abs(x - math.log2(value)) <= 0.25
    assert how == 'roundoff', how
    return 0.1 <= x / value <= 10


def look_for(n, text=None):
    return exercises(text)[n][1].split('\nLook for: ')[1].split('\n\n')[0]


def look_for_mismatches(n, out, text=None):
    """Where exercise n's "Look for" paragraph in README.md (or `text`) disagrees with its snippet's output."""
    numbers, expected = stated(look_for(n, text)), LOOK_FOR[n](out)
    if len(numbers) != len(expected):
        return [f"exercise {n}'s Look for states {len(numbers)} numbers, its check reads {len(expected)}: "
                f"{[t for _, _, t in numbers]}"]
    return [f"exercise {n}: the README says {text}, the snippet gives {values} ({how})"
            for (_, _, text), (values, how) in zip(numbers, expected)
            if not all(close(text, v, how) for v in (values if isinstance(values, tuple) else (values,)))]


def exercise_output(printed, n, code=None):
    out, error = printed[code or snippet(exercises()[n][1])]
    assert error == '', error[-2000:]
    return out


@pytest.mark.parametrize('n', sorted(LOOK_FOR))
def test_exercise_look_for_states_what_its_snippet_prints(printed, n):
    assert look_for_mismatches(n, exercise_output(printed, n)) == []


def test_exercise_look_for_check_fails_when_a_readme_number_changes(printed):
    # the acceptance test, on a scratch copy of README.md: change a number of a "Look for" paragraph (its first by a
    # digit, then each by 20x) and the check above fails
    readme = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read()
    for n in LOOK_FOR:
        out, paragraph = exercise_output(printed, n), look_for(n)
        assert look_for_mismatches(n, out, readme) == []
        numbers = stated(paragraph)
        start, end, text = numbers[0]
        first = re.search(r'[1-9]', text)  # its first significant digit, one up (9: down to 1)
        changed = text[:first.start()] + str(int(first.group()) % 9 + 1) + text[first.end():]
        for start, end, changed in [(start, end, changed)] + [(s, e, f"{20 * float(t):g}") for s, e, t in numbers]:
            scratch = readme.replace(paragraph, paragraph[:start] + changed + paragraph[end:])
            assert look_for_mismatches(n, out, scratch), (n, changed)


def test_exercise_3_with_a_broken_formula_fails_its_look_for(printed):
    # drop k_i . k_j from the first-order formula: its error then halves with dt instead of quartering
    code = snippet(exercises()[3][1])
    assert BROKEN_FORMULA[0] in code
    out = exercise_output(printed, 3, code.replace(*BROKEN_FORMULA))
    assert look_for_mismatches(3, out)
    formula_errors = [error for _, _, error, _ in exercise_3_rows(out)]
    assert 1.7 < formula_errors[0] / formula_errors[1] < 2.3


def test_exercise_answers_hold_their_scalings_and_formulas(printed):
    answers = {n: ' '.join(body.split('<summary>Answer')[1].split())  # one line each
               for n, (_, body) in exercises().items() if '<summary>Answer' in body}
    # 1: leapfrog conserves the stated modified energy of the harmonic oscillator exactly (to rounding)
    assert '`k^2/2 + (1 - dt^2/4) q^2/2`' in answers[1]

    class Spring(Hamiltonian):  # V(q) = q^2/2
        def force(self, q, scale=1.0):
            return -scale * q
    h = Spring(1, 1, 1, 1, 'leapfrog', dt=0.3).double()
    dt, drift = h.dt.item(), [0.0, 0.0]  # 0.3 as float32 holds it; the largest change of the modified energy, of H
    q, k = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    energies = lambda q, k: (k.item() ** 2 / 2 + (1 - dt ** 2 / 4) * q.item() ** 2 / 2,
                             (k.item() ** 2 + q.item() ** 2) / 2)
    e0 = energies(q, k)
    with torch.no_grad():
        for _ in range(200):
            q, k = h(q, k)
            drift = [max(d, abs(e - e_0)) for d, e, e_0 in zip(drift, energies(q, k), e0)]
    assert drift[0] < 1e-12 and drift[1] > 1e-3
    # 2: a symplectic Jacobian's singular values pair as s, 1/s; Euler's do not
    rows = exercise_2_rows(exercise_output(printed, 2))
    assert '`s`, `1/s`' in answers[2]
    assert abs(rows['leapfrog', 'float64'][4] * rows['leapfrog', 'float64'][5] - 1) < 0.01
    assert abs(rows['euler', 'float64'][4] * rows['euler', 'float64'][5] - 1) > 0.5
    # 3: the change is first order, the formula's error and Euler's difference second; Euler's is "3% of the change"
    rows = exercise_3_rows(exercise_output(printed, 3))
    for column, order in ((1, 1), (2, 2), (3, 2)):
        assert all(abs(math.log2(a[column] / b[column]) - order) < 0.1 for a, b in zip(rows, rows[1:]))
    percent, at = re.search(r'(\d+)% of the change at `dt = ([\d.]+)`', answers[3]).groups()
    row = next(row for row in rows if row[0] == float(at))
    assert abs(100 * row[3] / row[1] - int(percent)) < 0.5
    # 4: silu' has the stated series (to order z^4), and the claimed growth law is what the smallest spreads show,
    # the growth slowing from there as SiLU bends away
    series = re.search(r"`silu'\(z\) = (.*?) \+ \.\.\.`", answers[4]).group(1)
    for z in (0.01, -0.02):
        assert abs(eval(series.replace('^', '**'), {'__builtins__': {}}, {'z': z}) - M.silu_grad(
            torch.tensor(z, dtype=torch.float64)).item()) < 1e-8
    factor, power = map(int, re.search(r'`spread\^(\d)`, (\d+)x per doubling', answers[4]).groups()[::-1])
    growth = [g for _, _, g in exercise_4_rows(exercise_output(printed, 4))[1:]]
    assert factor == 2 ** power and abs(growth[0] / factor - 1) < 0.05
    assert growth == sorted(growth, reverse=True) and growth[-1] < factor / 4


def test_exercise_5_prints_what_its_look_for_reads(printed):
    # trained here for 20 iterations, not the quick start's 2,000: the form of its output, not its numbers
    out = exercise_output(printed, 5)
    layers = re.findall(r'layer (\d): nonlinear [\d.]+%, dt \[', out)
    heads = re.findall(r'head (\d): total variation [\d.]+, argmax flips \d+/48, corr\(change, k_i.k_j\) [-+]\d', out)
    assert layers == [str(i) for i in range(len(layers))] and heads == [str(i) for i in range(len(heads))]
    assert len(layers) >= 2 and len(heads) >= 2
    line = re.search(r'\non: (.*)\n', out).group(1)
    assert len(line.encode()) == 48 and '\n' not in line  # one line of the validation text, named by Look for


def test_exercise_6_an_integrator_of_ones_own_is_checked_and_trains(monkeypatch):
    # the open-ended exercise as written: its addition to model.py (a copy of leapfrog), run in model's namespace as
    # if appended to the file, then exercise 1's harness on it and a few training steps of --attn=mine
    if not hasattr(M, 'INTEGRATORS'):
        pytest.skip('needs the integrator table (INTEGRATORS) in model.py')
    for table in ('INTEGRATORS', 'QK_TRANSFORMS'):  # copies: the entries go away after this test
        monkeypatch.setattr(M, table, type(getattr(M, table))(getattr(M, table)))
    exec(snippet(exercises()[6][1]), dict(vars(M)))
    pendulum = snippet(exercises()[1][1]).replace("for name in ('leapfrog', 'euler'):", "for name in ('mine',):")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(pendulum.split('try:')[0], {'__name__': '__main__'})  # the harness, not the picture
    e = dict(re.findall(r'mine +dt=([\d.]+): largest energy error (\S+)', out.getvalue()))
    assert 3.5 < float(e['0.1']) / float(e['0.05']) < 4.5  # as leapfrog's: order 2
    model = build('mine')
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), 'cpu')
    idx = idx_batch(B=4)
    losses = []
    for _ in range(6):
        loss = model(idx[:, :-1], targets=idx[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and flops_per_token(tiny('mine'), 16) > flops_per_token(tiny('standard'), 16)
