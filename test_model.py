"""
The spec of the mathematics, in pytest: what each attention variant of model.py promises. dt = 0 is standard
attention, leapfrog is reversible and keeps volume, the closed-form force is the gradient of V, no position sees
the future, the KV cache equals the full forward pass, the parameter budgets, and each table entry's own claims
(`pytest -k <name>`). The scripts' tests are test_scripts.py, the lab's exercises/test_lab.py, the record's
results/test_results.py; conftest.py is their shared harness, and the one command runs them all.
Run: python -m pytest -q
"""
import contextlib
import dataclasses
import itertools
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as M
from model import (FORCES, INTEGRATORS, PRESETS, QK_TRANSFORMS, GPT, GPTConfig, Hamiltonian, Integrator, Invertible,
                   KVCache, attn_names, flops_per_token, qk_diagnostics)

from conftest import run

ATTN = attn_names()
TRANSFORMS = [a for a in ATTN if a not in ('standard', 'diff')]  # variants with a q/k map


def built_on(key):
    """The pytest id of a FORCES (key 'force') or INTEGRATORS name: it and the entries built on it, so that `pytest -k
    <entry>` runs the tests of its force and its integrator too, whatever they are named."""
    return lambda name: f"{name}({','.join(e for e, s in QK_TRANSFORMS.items() if s.args(tiny(e)).get(key) == name)})"


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
    (dict(pos='alibi'), 'rope'),
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
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    stepped = {id(p) for g in opt.param_groups for p in g['params']}
    for qk in qk_maps(model):  # dt, and the per-head scalars it declares, are parameters the optimizer steps
        for s in set(getattr(qk, 'scalars', ())) | {'dt'} & set(dir(qk)):
            p = getattr(qk, s)
            assert id(p) in stepped and p.grad is not None, f"{attn}'s {s} is not learned: " + (
                "no gradient reaches it" if id(p) in stepped else "not a parameter the optimizer steps")


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
    where, err = differing(a[:, :t + 1], b[:, :t + 1], 1e-6)
    assert not where, (f"{attn} ({pos}) leaks the future: changing tokens {t + 1}.. moves the logits of positions "
                       f"{where} by up to {err:.1e}")
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:], atol=1e-4)  # the change is visible afterwards


def differing(a, b, atol):  # the positions t at which a, b (B, T, ...) are not allclose, and the largest |a - b|
    apart = ~torch.isclose(a, b, atol=atol)
    return apart.flatten(2).any(-1).any(0).nonzero().flatten().tolist(), (a - b).abs().max().item()


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


@pytest.mark.parametrize('force', FORCES, ids=built_on('force'))
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


def flow(qk, q, k, n=64):
    """(q, k) at time 1 of the flow q' = k, k' = F(q), F = qk.force: n classical Runge-Kutta steps (error ~ n^-4)."""
    F, h = lambda x: qk.force(x, torch.ones(x.size(0), 1, 1, dtype=x.dtype)), 1 / n  # x: (nh, N, hs)
    for _ in range(n):  # the slopes (dq, dk) at four points
        a, A = k, F(q)
        b, B = k + h / 2 * A, F(q + h / 2 * a)
        c, C = k + h / 2 * B, F(q + h / 2 * b)
        d, D = k + h * C, F(q + h * c)
        q, k = q + h / 6 * (a + 2 * b + 2 * c + d), k + h / 6 * (A + 2 * B + 2 * C + D)
    return q, k


@torch.no_grad()
def order_failure(name, p, make):
    """What refutes order p ('' if nothing): the error at time 1 after n calls of dt = 1/n falls ~2^p-fold as n
    doubles from 8 (or is rounding's), against the true flow q' = k, k' = F(q) where the map steps a table integrator
    with a force F (first with F = 0, whose flow lands on (q + k, k)), else against 1024 calls' (self-convergence)."""
    q, k = qk_pair(B=1, nh=1, T=3, hs=4, seed=7)
    qk, zero = make(1), make(1)
    if isinstance(qk, Hamiltonian) and type(qk).step is Hamiltonian.step:
        zero.force = lambda x, scale=1.0: 0 * x
        refs = [(zero, "with F = 0, against the flow's (q + k, k)", (q + k, k)),
                (qk, "against the flow q' = k, k' = F(q)", tuple(x[None] for x in flow(qk, q[0], k[0])))]
    else:
        refs = [(qk, "against 1024 calls' (no equation known)", None)]
    for qk, against, want in refs:
        errors = {}
        for n in (1024, 16, 8)[want is not None:]:
            x = (q, k)
            with step_size(qk, 1 / (n * qk.dt[0].item())):
                for _ in range(n):
                    x = qk(*x)
            want = want or x
            errors[n] = max((a - b).abs().max().item() for a, b in zip(x, want))
        ratio = errors[8] / errors[16]
        if errors[16] > 1e-10 and not 0.7 * 2 ** p < ratio < 1.4 * 2 ** p:
            return f"{name} claims order={p}: the error falls {ratio:.1f}x as dt halves, {against}"
    return ''


def claim_failure(name, claim, claimed, make):
    """What refutes a claim ('' if nothing): measured when it can be; a map without a step size dt can claim no
    symmetry, order or identity."""
    if claim in ('symmetric', 'order', 'identity_at_zero') and not hasattr(make(1), 'dt'):
        return f"{name} claims {claim}={claimed}, but has no step size dt to test it with" if claimed else ''
    if claim == 'order':
        return '' if claimed is None else order_failure(name, claimed, make)
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
@pytest.mark.parametrize('name', INTEGRATORS, ids=built_on('integrator'))
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



@pytest.mark.parametrize('name', QK_TRANSFORMS)
def test_each_entrys_gradient_force_is_minus_the_gradient_of_the_potential_it_states(name):
    f = getattr(entry_map(name), 'f', None)
    if not getattr(f, 'gradient', False):
        pytest.skip(f"{name} has no force that claims to be a gradient")
    assert hasattr(f, 'V'), f"{name}'s force claims gradient=True but states no potential V(q)"
    q = qk_pair(B=1, nh=1, T=5, hs=4, seed=3)[0].requires_grad_(True)
    (grad,) = torch.autograd.grad(f.V(q).sum(), q)  # autograd's grad V, the potential summed over tokens
    force = f(q).detach()
    assert grad.abs().max() > 1e-3
    assert not torch.allclose(force, grad, atol=1e-10), f"{name}'s force has the wrong sign: F = +grad V"
    err = (force + grad).abs().max().item()
    assert err < 1e-10, f"{name}'s force is not -grad V of the potential V it states: off by {err:.1e}"


@pytest.mark.parametrize('name', QK_TRANSFORMS)
def test_each_entrys_map_keeps_its_heads_apart(name):
    torch.manual_seed(0)
    qk = one_head(M.qk_transform(name, 3, 4, tiny(name, qk_steps=2, qk_hidden=8, qk_scale=0)))  # 3 heads of 4
    q, k = qk_pair(B=2, nh=3, T=5, hs=4)
    moved_q, moved_k = q.clone(), k.clone()
    moved_q[:, 1] += 1.0  # head 1's q and k move; heads 0 and 2 must not see it
    moved_k[:, 1] -= 0.5
    with torch.no_grad():
        before, again, after = qk(q, k), qk(q, k), qk(moved_q, moved_k)
    err = max((a - b).abs().max().item() for a, b in zip(before, again))
    assert err < 1e-12, f"{name} is not a function of its input: two calls on one input differ by {err:.1e}"
    others = max((a[:, h] - b[:, h]).abs().max().item() for a, b in zip(before, after) for h in (0, 2))
    assert max((a[:, 1] - b[:, 1]).abs().max().item() for a, b in zip(before, after)) > 1e-3
    assert others < 1e-12, f"{name} mixes heads: moving head 1's q and k moves heads 0 and 2 by {others:.1e}"

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

    def forward(self, q, k):  # (B, nh, T, hs) -> the same; g in q's dtype (bf16 under autocast)
        g = self.g.to(q.dtype)
        return g * q / q.norm(dim=-1, keepdim=True), g * k / k.norm(dim=-1, keepdim=True)


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
    assert len(ran) > 25 and all('dt_zero' in what or 'gradient_force' in what for what in skipped), (
        len(ran), skipped)  # no identity claimed, no force
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



class LogCosh(M.HeadMLP):
    """A forker's force: F(q) = -grad V(q), V(q) = sum_j a_j log cosh(w_j . q + b_j) per head (w_j: the rows of W),
    in closed form F(q) = -W^T (a * tanh(W q + b)). Its entry: QK_TRANSFORMS['coupled-logcosh'] =
    dynamics('leapfrog', 'logcosh'), after FORCES['logcosh'] = LogCosh; `pytest -k coupled-logcosh` runs the tests of
    its force and its integrator too (their ids name the entries built on each)."""
    gradient = True
    flops = staticmethod(lambda hs, m: (4 * m * hs, 3 * m))  # W q, (.) W; + b, tanh, * a

    def __init__(self, n_head, head_size, hidden, w_std=None):
        super().__init__(n_head, head_size, hidden, 1, w_std=w_std)  # W (nh, m, hs), b (nh, 1, m), a (nh, 1, m)

    def V(self, q):  # the potential, (..., nh, N, hs) -> (..., nh, N)
        return (torch.log(torch.cosh(self.pre(q))) @ self.a.transpose(1, 2)).squeeze(-1)

    def forward(self, q, scale=1.0):  # scale F(q) = -W^T (scale a * tanh(W q + b))
        return (torch.tanh(self.pre(q)) * (-scale * self.a)) @ self.W


def add_force(monkeypatch, force):  # FORCES[name] = force, and its leapfrog entry QK_TRANSFORMS[name]; the name
    name = new_name('logcosh')
    monkeypatch.setitem(FORCES, name, force)
    monkeypatch.setitem(QK_TRANSFORMS, name, M.dynamics('leapfrog', name))
    return name


def test_a_log_cosh_force_added_through_the_tables_alone_passes_every_per_entry_test(monkeypatch):
    name = add_force(monkeypatch, LogCosh)
    ran = [what for what, call in per_entry_tests(name) if call() is None]
    assert len(ran) > 30 and any('gradient_force' in what for what in ran), len(ran)
    assert QK_TRANSFORMS[name].symplectic and QK_TRANSFORMS[name].order == 2
    entry = 'coupled-' + name  # named as the docstring names it: the ids of its force's and integrator's tests say it
    monkeypatch.setitem(QK_TRANSFORMS, entry, M.dynamics('leapfrog', name))
    over = {id(FORCES): name, id(INTEGRATORS): 'leapfrog'}
    ids = [m.kwargs.get('ids', str)(over[id(m.args[1])]) for test in globals().values()
           for m in getattr(test, 'pytestmark', []) if m.name == 'parametrize' and id(m.args[1]) in over]
    assert len(ids) >= 2 and all(entry in i for i in ids), ids


class SignFlipped(LogCosh):  # F = +grad V: still a gradient (of -V), so every claim of the step holds
    def forward(self, q, scale=1.0):
        return -super().forward(q, scale)


class WrongV(LogCosh):  # the V it states is not the potential of its F (softplus, not log cosh)
    def V(self, q):
        return (F.softplus(self.pre(q)) @ self.a.transpose(1, 2)).squeeze(-1)


class Noisy(LogCosh):  # a random draw in the force
    def forward(self, q, scale=1.0):
        return super().forward(q + 1e-3 * torch.randn_like(q), scale)


class AcrossHeads(QKNorm):  # QK-norm over the heads (dim=1), not within each head
    def forward(self, q, k):
        return self.g * q / q.norm(dim=1, keepdim=True), self.g * k / k.norm(dim=1, keepdim=True)


class Leaky(QKNorm):  # each key takes in the next position's: position t sees t + 1
    def forward(self, q, k):
        return super().forward(q, k + k.roll(-1, dims=2))


class Float32(QKNorm):  # bf16 in, float32 out
    def forward(self, q, k):
        return tuple(x.float() for x in super().forward(q, k))


class RowsMixed(Hamiltonian):  # (B, nh, T, hs) -> (nh, B*T, hs) by a reshape without the transpose: row b, head h
    def forward(self, q, k, dt=None):  # is stepped with the force of head (b nh + h) // B
        B, nh, T, hs = q.shape
        dt = (self.dt if dt is None else dt).view(nh, 1, 1)
        q, k = (x.reshape(nh, B * T, hs) for x in (q, k))
        for _ in range(self.steps):
            q, k = self.step(q, k, dt)
        return q.reshape(B, nh, T, hs), k.reshape(B, nh, T, hs)


class DtBuffer(Hamiltonian):  # dt a buffer, and no `scalars` declared: it never learns
    scalars = ()

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.register_buffer('dt', self._parameters.pop('dt').detach())


class OneStep(Hamiltonian):  # one step, whatever --qk_steps says
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.steps = 1


def drift_twice(h, q, k, dt):  # leapfrog of the wrong equation: its drift q += 2 dt k follows q' = 2 k
    k = k + h.force(q, dt / 2)
    q = q + 2 * dt * k
    return q, k + h.force(q, dt / 2)


PLANTED = {  # a forker's mistake (a force, a map or a step): [(the per-entry test whose name holds this, its other
    # arguments, what it says after the entry's name)]
    SignFlipped: [('gradient_force', "'s force has the wrong sign")],
    WrongV: [('gradient_force', "'s force is not -grad V of the potential V it states")],
    Noisy: [('heads_apart', " is not a function of its input: two calls on one input differ")],
    AcrossHeads: [('heads_apart', " mixes heads: ")],
    RowsMixed: [('acts_per_token', " mixes batch rows: a row alone differs from itself in a batch")],
    drift_twice: [(test, 'order', " claims order=2: the error falls 1.0x as dt halves, with F = 0, against the flow")
                  for test in ('each_entry_keeps', 'each_integrator_keeps')],
    DtBuffer: [('gradients_reach', "'s dt is not learned: not a parameter the optimizer steps")],
    OneStep: [('builds_its_declared', " does not honour steps: qk_steps=2 is not two calls at qk_steps=1")],
    Leaky: [('causality', 'learned', " (learned) leaks the future: changing tokens 7.. moves the logits of"),
            ('kv_cache', 'learned', " (learned) fed a prompt of 5, then one token at a time through a KV cache")],
    Float32: [('builds_its_declared', " returns {'torch.float32'} q and k for bf16 ones under bf16 autocast")],
}


@pytest.mark.parametrize('mistake', PLANTED, ids=lambda m: m.__name__)
def test_a_forkers_planted_mistake_fails_its_entrys_tests_naming_the_entry_and_the_property(mistake, monkeypatch):
    # in a new entry, `pytest -k <entry>` fails (float32 q, k under autocast: warns) saying which and what
    name = new_name(mistake.__name__.lower())
    if mistake in QKNorm.__subclasses__():  # a map without dynamics
        spec = QK_NORM._replace(cls=mistake)
    elif mistake in Hamiltonian.__subclasses__():  # leapfrog's map, changed
        spec = M.dynamics('leapfrog', cls=mistake)
    elif isinstance(mistake, type):  # a force
        monkeypatch.setitem(FORCES, name, mistake)
        spec = M.dynamics('leapfrog', name)
    else:  # a step, claiming leapfrog's promises
        monkeypatch.setitem(INTEGRATORS, name, INTEGRATORS['leapfrog']._replace(step=mistake))
        spec = M.dynamics(name)
    monkeypatch.setitem(QK_TRANSFORMS, name, spec)
    for part, *args, said in PLANTED[mistake]:
        [test] = [t for n, t in globals().items() if n.startswith('test_') and part in n]
        with (pytest.warns(UserWarning, match=re.escape(name + said)) if mistake is Float32 else
              pytest.raises(AssertionError, match=re.escape(name + said))):
            test(name, *args)


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
    # the map of token (b, t) depends on it only: shuffling positions commutes with it, and each batch row alone gives
    # what it gives in a batch (16 rows in training, 1 when generating)
    model = build(attn)
    randomize_qk(model)
    qk = qk_maps(model)[0].double()  # float64: a strong map's float32 rounding is no part of the question
    q, k = qk_pair(B=3, nh=4, T=6, hs=8)
    perm = torch.randperm(6)
    with torch.no_grad():
        out, shuffled = qk(q, k), qk(q[:, :, perm], k[:, :, perm])
        rows = [torch.cat(x) for x in zip(*(qk(q[b:b + 1], k[b:b + 1]) for b in range(3)))]
    assert [x.shape for x in out] == [q.shape] * 2
    for what, got, want in (('positions: shuffled, they move', shuffled, [x[:, :, perm] for x in out]),
                            ('batch rows: a row alone differs from itself in a batch of 3', rows, out)):
        err = max((a - b).abs().max().item() for a, b in zip(got, want))
        assert err < 1e-10, f"{attn} mixes {what} by {err:.1e}"


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
    # a chunk of several new tokens on top of a cache is masked causally too
    cache = KVCache(model.config.n_layer)
    parts = [model(idx[:, :4], cache=cache)[0], model(idx[:, 4:12], cache=cache)[0]]
    for how, got in (('a prompt of 5, then one token at a time', steps), ('4 tokens, then 8', parts)):
        where, err = differing(torch.cat(got, dim=1), full, 1e-5)
        assert not where, (f"{attn} ({pos}) fed {how} through a KV cache differs from the full forward at "
                           f"positions {where}, by up to {err:.1e}: there a position sees a later one, or other keys")


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
    with torch.autocast('cpu', dtype=torch.bfloat16):  # (diff+name's map) float32 q', k' cost speed, not correctness
        dtypes = {str(x.dtype) for x in qk(*torch.randn(2, 2, 4, 16, 8).bfloat16())}
    if dtypes != {'torch.bfloat16'}:
        warnings.warn(f"{name} returns {dtypes} q and k for bf16 ones under bf16 autocast: its work and memory are "
                      "float32's (cast its parameters to q.dtype, as Hamiltonian casts dt)")
    if 'steps' in M.takes(spec.cls):  # --qk_steps=n is n calls of one step
        one, two = entry_map(name, 1), entry_map(name, 2)
        two.load_state_dict(one.state_dict())
        q, k = qk_pair(B=1, nh=1, T=3, hs=4)
        with torch.no_grad():
            err = max((a - b).abs().max().item() for a, b in zip(two(q, k), one(*one(q, k))))
        assert err < 1e-10, f"{name} does not honour steps: qk_steps=2 is not two calls at qk_steps=1 ({err:.1e} off)"
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
