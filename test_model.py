"""
The spec of the mathematics, in pytest: what each attention variant of model.py promises. dt = 0 is standard
attention, leapfrog is reversible and keeps volume, the closed-form force is the gradient of V, no position sees
the future, the KV cache equals the full forward pass, the parameter budgets, and each table entry's own claims
(`pytest -k <name>`). The scripts' tests: test_scripts.py; the lab's: exercises/test_lab.py; the record's:
results/test_results.py; their harness: conftest.py. Run: python -m pytest -q
"""
import itertools
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as M
from model import (FORCES, INTEGRATORS, PRESETS, QK_TRANSFORMS, GPT, GPTConfig, Hamiltonian, Invertible, KVCache,
                   attn_names, flops_per_token, qk_diagnostics)

from conftest import (CLAIMS, Elementwise, assert_integrator_keeps, claim_failure, hamiltonian, one_head, qk_pair,
                      yoshida)

ATTN = attn_names()
TRANSFORMS = [a for a in ATTN if a not in ('standard', 'diff')]  # variants with a q/k map


def built_on(integrator):
    """The pytest id of an INTEGRATORS name: it and the entries built on it, so that `pytest -k <entry>` runs the tests
    of its integrator too, whatever it is named."""
    entries = [e for e, spec in QK_TRANSFORMS.items() if spec.args(tiny(e)).get('integrator') == integrator]
    return f"{integrator}({','.join(entries)})"


def tiny(attn='standard', **kw):
    cfg = dict(block_size=16, vocab_size=50, n_layer=2, n_head=4, n_embd=32, attn=attn)
    cfg.update(kw)
    return GPTConfig(**cfg)


def build(attn='standard', seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(tiny(attn, **kw), verbose=False)


def qk_maps(model):
    return [blk.attn.qk for blk in model.transformer.h]


def randomize_qk(model, scale=0.5, seed=1):  # every q/k map off its initialization (invertible's zero last layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.qk_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def idx_batch(B=2, T=16, vocab=50, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# configuration

@pytest.mark.parametrize('kw, words', [
    (dict(attn='diffusion'), "attn='diffusion' is unknown"),  # [diff+]<entry>, split on '+': no prefix is stripped
    (dict(attn='diff+diff'), 'diff'),
    (dict(attn='standard+coupled'), r'diff\+coupled'),
    (dict(pos='alibi'), 'rope'),
])
def test_bad_config_says_what_is_allowed(kw, words):
    with pytest.raises(ValueError, match=words):
        tiny(**kw)


# ---------------------------------------------------------------------------------------------------------------
# every variant: gradients, and a q/k map at its identity

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


def base_and(attn, seed=1):  # base attention (standard or diff), and attn with the same weights wherever they agree
    ref, model = build('diff' if tiny(attn).diff else 'standard'), build(attn, seed=seed)
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all('.qk.' in n for n in missing)
    return ref, model


@pytest.mark.parametrize('attn', ['coupled', 'diff+coupled', 'invertible', 'diff+invertible'])
def test_a_map_at_its_identity_is_exactly_the_base_attention(attn):
    # coupled at dt = 0, any weights; invertible at its init: the model is standard (diff) attention, bit for bit
    # (the map alone: its entry's claim identity_at_zero, below)
    ref, model = base_and(attn)
    if 'coupled' in attn:
        randomize_qk(model)
        with torch.no_grad():
            for qk in qk_maps(model):
                qk.dt.zero_()
    idx = idx_batch()
    assert torch.equal(model(idx)[0], ref(idx)[0])
    randomize_qk(model)  # off its identity the logits move: the test can fail
    assert not torch.allclose(model(idx)[0], ref(idx)[0], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the Hamiltonian dynamics, on their own

def new_name(stem):  # a name no table holds (not even a forker's entry)
    return next(f'{stem}-{i}' for i in itertools.count() if f'{stem}-{i}' not in {**INTEGRATORS, **QK_TRANSFORMS,
                                                                                    **FORCES})


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


def test_leapfrog_is_kick_drift_kick():  # (its claims hold for any symmetric symplectic 2nd-order step)
    h = hamiltonian('leapfrog', 3)
    q, k = qk_pair()
    q1, k1 = h(q, k)
    dt = h.dt.view(-1, 1, 1)
    q, k = (x.transpose(0, 1).reshape(3, -1, 8) for x in (q, k))
    for _ in range(3):  # both forces computed each step (nothing handed on): the same numbers, bit for bit
        k = k + h.force(q, dt / 2)
        q = q + dt * k
        k = k + h.force(q, dt / 2)
    q1, k1 = (x.transpose(0, 1).reshape(3, -1, 8) for x in (q1, k1))
    assert torch.equal(q1, q) and torch.equal(k1, k)


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


# ---------------------------------------------------------------------------------------------------------------
# every entry keeps what it promises: the claims of QK_TRANSFORMS (and of INTEGRATORS, with the potential's force),
# measured by conftest.py on one head of a map moved off its initialization. `pytest -k <name>` runs them

def entry_map(name, steps=2, hs=4):  # QK_TRANSFORMS[name]'s map for one head, as the model builds it
    torch.manual_seed(0)
    return one_head(M.qk_transform(name, 1, hs, tiny(name, qk_steps=steps, qk_hidden=8, qk_scale=0)))


@pytest.mark.parametrize('claim', CLAIMS)
@pytest.mark.parametrize('name', QK_TRANSFORMS)
def test_each_entry_keeps_what_it_promises(name, claim):
    # coupled (leapfrog): symplectic, volume-preserving, symmetric (reversible by -dt); euler: none of them;
    # coupled-mlp: not symplectic (a free force is the gradient of nothing); invertible: no dt, so no such claims
    failure = claim_failure(name, claim, getattr(QK_TRANSFORMS[name], claim), lambda steps: entry_map(name, steps))
    assert not failure, failure


@pytest.mark.parametrize('claim', CLAIMS[:-1])
@pytest.mark.parametrize('name', INTEGRATORS, ids=built_on)
def test_each_integrator_keeps_what_it_promises_under_the_potential(name, claim):
    # symplectic-euler (kick, then drift) is symplectic like leapfrog but, unlike it, first order and not symmetric
    assert_integrator_keeps(name, claim)


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


# A forker's new entry, added to the tables alone: an honest one passes every per-entry test; a mistake fails, naming
# the entry and what is wrong

class Damped(Hamiltonian):
    """A forker's change of the step: k <- (1 - gamma) k after each step, gamma learned per head, (nh, 1, 1)."""
    scalars = ('dt', 'gamma')

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gamma = torch.nn.Parameter(torch.full((self.dt.numel(), 1, 1), 0.2))

    def step(self, q, k, dt):
        q, k = super().step(q, k, dt)
        return q, (1 - self.gamma.to(k.dtype)) * k  # (in k's dtype: bf16 under autocast)


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


class LogCosh(M.HeadMLP):
    """A forker's force: F(q) = -grad V(q), V(q) = sum_j a_j log cosh(w_j . q + b_j) per head (w_j: the rows of W),
    in closed form F(q) = -W^T (a * tanh(W q + b)); its entry: FORCES['logcosh'] = LogCosh, then
    QK_TRANSFORMS['coupled-logcosh'] = dynamics('leapfrog', 'logcosh')."""
    gradient = True
    flops = staticmethod(lambda hs, m: (4 * m * hs, 3 * m))  # W q, (.) W; + b, tanh, * a

    def __init__(self, n_head, head_size, hidden, w_std=None):
        super().__init__(n_head, head_size, hidden, 1, w_std=w_std)  # W (nh, m, hs), b (nh, 1, m), a (nh, 1, m)

    def V(self, q):  # the potential, (..., nh, N, hs) -> (..., nh, N)
        return (torch.log(torch.cosh(self.pre(q))) @ self.a.transpose(1, 2)).squeeze(-1)

    def forward(self, q, scale=1.0):  # scale F(q) = -W^T (scale a * tanh(W q + b))
        return (torch.tanh(self.pre(q)) * (-scale * self.a)) @ self.W


def add_entry(monkeypatch, part, **claims):
    """A forker's entry built on part (a map, a Hamiltonian with its own step, a force stepped by leapfrog, or a step
    with leapfrog's claims and cost unless claims say otherwise), under a name no table holds: that name."""
    name = new_name(part.__name__.lower())
    if isinstance(part, type) and issubclass(part, QKNorm):
        spec = QK_NORM._replace(cls=part, **claims)
    elif isinstance(part, type) and issubclass(part, Hamiltonian):
        spec = M.dynamics('leapfrog', cls=part, **claims)
    elif isinstance(part, type):
        monkeypatch.setitem(FORCES, name, part)
        spec = M.dynamics('leapfrog', name, **claims)
    else:
        monkeypatch.setitem(INTEGRATORS, name, INTEGRATORS['leapfrog']._replace(step=part, **claims))
        spec = M.dynamics(name)
    monkeypatch.setitem(QK_TRANSFORMS, name, spec)
    return name


def per_entry_tests(name):
    """(id, call) of each test parametrized by all entries (QK_TRANSFORMS, TRANSFORMS or ATTN), with name where coupled
    and diff+coupled stand: a new per-entry test counts without being listed here."""
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


HONEST = {  # a forker's honest entry of each kind: what it claims beyond its parts; why tests skip it
    QKNorm: ({}, {'has no force that claims to be a gradient'}),  # no dt (no symmetry, order or identity to claim)
    Damped: (dict(symplectic=False, volume_preserving=False, symmetric=False, order=None, identity_at_zero=False,
                  flops=None), {'states no FLOP price'}),  # a learned per-head scalar; no price
    LogCosh: ({}, set()),
    yoshida: (dict(order=4, forces=6, vector_ops=12), set()),  # three leapfrog steps, fourth order
}


@pytest.mark.parametrize('part', HONEST, ids=lambda part: part.__name__)
def test_an_honest_new_entry_passes_every_per_entry_test(part, monkeypatch):
    claims, skips = HONEST[part]
    name = add_entry(monkeypatch, part, **claims)
    ran, skipped = 0, set()
    for what, call in per_entry_tests(name):
        try:
            call()
            ran += 1
        except pytest.skip.Exception as e:
            skipped.add(e.msg.removeprefix(name + ' '))
    assert ran >= 20 and skipped == skips, (ran, skipped)
    integrator = QK_TRANSFORMS[name].args(tiny(name)).get('integrator')  # `pytest -k <name>` runs its tests too
    assert integrator is None or name in built_on(integrator).split('(')[1][:-1].split(','), built_on(integrator)
    if QK_TRANSFORMS[name].flops is None:  # it trains without a price; a count of FLOPs asks for one
        with pytest.raises(ValueError, match=f"^{name} has no FLOP price"):
            flops_per_token(GPTConfig(attn=name), 128)


def test_a_q_k_maps_own_layer_keeps_its_initialization_and_decays_as_a_matrix(monkeypatch):
    # an nn.Linear in a q/k map, zero-initialized on purpose, stays zero (GPT's init still reaches c_attn); with
    # --qk_decay its weight decays as a matrix, its bias never
    class Mixed(QKNorm):
        def __init__(self, n_head, head_size):
            super().__init__(n_head, head_size)
            self.mix = nn.Linear(head_size, head_size)
            nn.init.zeros_(self.mix.weight)

        def forward(self, q, k):
            return super().forward(q + self.mix(q), k)
    name = add_entry(monkeypatch, Mixed)
    model = build(name)
    assert all(not qk.mix.weight.any() for qk in qk_maps(model))
    assert 0.015 < model.transformer.h[0].attn.c_attn.weight.std() < 0.025
    test_qk_decay_falls_on_the_declared_matrices_only(name)


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


def overclaimed(h, q, k, dt):  # explicit Euler's step, entered with leapfrog's claims and cost
    return M.euler(h, q, k, dt)


PLANTED = {  # a forker's mistake, as add_entry takes it: [(the per-entry test whose name holds this, its other
    # arguments, what it says after the entry's name)]
    SignFlipped: [('gradient_force', "'s force has the wrong sign")],
    WrongV: [('gradient_force', "'s force is not -grad V of the potential V it states")],
    Noisy: [('on_each_token', " is not a function of its input: two calls on one input differ")],
    AcrossHeads: [('on_each_token', " mixes heads: ")],
    RowsMixed: [('on_each_token', " mixes batch rows: a row alone differs from itself in a batch")],
    drift_twice: [(test, 'order', " claims order=2: the error falls 1.0x as dt halves, with F = 0, against the flow")
                  for test in ('each_entry_keeps', 'each_integrator_keeps')],
    overclaimed: [('each_entry_keeps', 'symplectic', " claims symplectic=True: |J^T Omega J - Omega| = "),
                  ('elementwise_price', 1, " prices its elementwise work at ")],
    DtBuffer: [('gradients_reach', "'s dt is not learned: not a parameter the optimizer steps")],
    OneStep: [('builds_its_declared', " does not honour steps: qk_steps=2 is not two calls at qk_steps=1")],
    Leaky: [('sees_the_future', 'learned', " (learned) leaks the future: changing tokens 7.. moves the logits of")],
    Float32: [('builds_its_declared', " returns {'torch.float32'} q and k for bf16 ones under bf16 autocast")],
}


@pytest.mark.parametrize('mistake', PLANTED, ids=lambda m: m.__name__)
def test_a_forkers_planted_mistake_fails_its_entrys_tests_naming_the_entry_and_the_property(mistake, monkeypatch):
    # `pytest -k <entry>` fails (float32 q, k under autocast: warns), saying which entry and what
    name = add_entry(monkeypatch, mistake)
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
def test_invertible_coupling_inverts_exactly(steps):  # (no dt: no symmetry claim to measure; its inverse instead)
    torch.manual_seed(0)
    inv = Invertible(3, 8, 4, steps).double()
    q, k = qk_pair()
    with torch.no_grad():
        for p in inv.parameters():
            p.add_(0.5 * torch.randn_like(p))
    q1, k1 = inv(q, k)
    assert (k1 - k).abs().max() > 0.1
    q0, k0 = invert(inv, q1, k1)
    assert torch.allclose(q0, q, atol=1e-10) and torch.allclose(k0, k, atol=1e-10)


@pytest.mark.parametrize('name', QK_TRANSFORMS)
def test_each_entrys_map_acts_on_each_token_and_head_alone(name):
    # token (b, t) of head h depends on it only: two calls agree; moving head 1 moves no other; shuffling positions
    # commutes with the map; a batch row alone gives what it gives in a batch (1 row when generating)
    torch.manual_seed(0)
    qk = one_head(M.qk_transform(name, 3, 4, tiny(name, qk_steps=2, qk_hidden=8, qk_scale=0)))  # 3 heads of 4
    q, k = qk_pair(B=3, nh=3, T=6, hs=4)
    moved_q, moved_k, perm = q.clone(), k.clone(), torch.randperm(6)
    moved_q[:, 1] += 1.0
    moved_k[:, 1] -= 0.5
    with torch.no_grad():
        out, again, moved, shuffled = qk(q, k), qk(q, k), qk(moved_q, moved_k), qk(q[:, :, perm], k[:, :, perm])
        rows = [torch.cat(x) for x in zip(*(qk(q[b:b + 1], k[b:b + 1]) for b in range(3)))]
    gap = lambda a, b, heads=slice(None): max((x[:, heads] - y[:, heads]).abs().max().item() for x, y in zip(a, b))
    assert [x.shape for x in out] == [q.shape] * 2 and gap(moved, out, 1) > 1e-3
    for err, what in ((gap(again, out), " is not a function of its input: two calls on one input differ"),
                      (gap(moved, out, [0, 2]), " mixes heads: moving head 1's q and k moves heads 0 and 2"),
                      (gap(shuffled, [x[:, :, perm] for x in out]), " mixes positions: shuffled, they move"),
                      (gap(rows, out), " mixes batch rows: a row alone differs from itself in a batch of 3")):
        assert err < 1e-10, f"{name}{what} by {err:.1e}"


# ---------------------------------------------------------------------------------------------------------------
# differential attention

def test_diff_lambda_init_schedule():
    model = build('diff', n_layer=4)
    got = [blk.attn.lambda_init for blk in model.transformer.h]
    want = [0.8 - 0.6 * math.exp(-0.3 * layer) for layer in range(4)]
    assert got == pytest.approx(want)


# ---------------------------------------------------------------------------------------------------------------
# causality, the KV cache and generation

def differing(a, b, atol):  # the positions t at which a, b (B, T, ...) are not allclose, and the largest |a - b|
    apart = ~torch.isclose(a, b, atol=atol)
    return apart.flatten(2).any(-1).any(0).nonzero().flatten().tolist(), (a - b).abs().max().item()


@pytest.mark.parametrize('attn', ATTN)
@pytest.mark.parametrize('pos', ['learned', 'rope'])
def test_no_position_sees_the_future_and_a_kv_cache_gives_the_full_forward(attn, pos):
    model = build(attn, pos=pos).eval()
    randomize_qk(model)
    idx = idx_batch(T=12)
    full = model(idx)[0]
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 7) % 50
    later = model(changed)[0]
    where, err = differing(later[:, :7], full[:, :7], 1e-6)
    assert not where, (f"{attn} ({pos}) leaks the future: changing tokens 7.. moves the logits of positions {where} "
                       f"by up to {err:.1e}")
    assert not torch.allclose(later[:, 7:], full[:, 7:], atol=1e-4)  # the change is seen where it may be
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


def test_the_papers_parameter_budgets_at_60m():
    n_std, count = count_60m('standard')[0], lambda attn: count_60m(attn)[1]
    assert 55e6 < n_std < 70e6
    for attn in ('coupled', 'euler-mlp', 'coupled-mlp'):  # the paper: 0.11%
        n, n_qk = count_60m(attn)
        assert n - n_std == n_qk and 0.0010 <= n_qk / n_std <= 0.0012, attn
    assert count('euler-mlp') == 12 * 8 * (2 * 6 * 64 + 6 + 1)  # layers x heads x (W, A, b; dt): 74,400, 6 wide
    assert 0.0025 <= count('invertible') / n_std <= 0.0035  # v2: about 0.3%
    for attn in ('uncoupled', 'euler'):  # the baselines: coupled's capacity
        assert abs(count(attn) - count('coupled')) / count('coupled') <= 0.03, attn
    n_diff = count_60m('diff')[0]  # differential attention: within 1% of standard's
    assert n_diff != n_std and abs(n_diff - n_std) / n_std < 0.01


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
def test_a_few_adamw_steps_lower_the_loss_from_chance(attn):
    model = build(attn)
    idx = idx_batch()
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (2, 16, 50) and torch.equal(model(idx)[0], logits) and model(idx)[1] is None
    losses = adamw_losses(model)
    assert abs(losses[0] - math.log(50)) < 1.0 and losses[-1] < losses[0] - 0.2  # near chance at init


def decayed(model):  # the parameters AdamW decays, by id
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    return {id(p) for g in opt.param_groups if g['weight_decay'] > 0 for p in g['params']}


def test_weight_decay_falls_on_the_linear_and_embedding_matrices():
    # not on norms' gains, diff's lambda vectors or a q/k map (with --qk_decay: below), wherever the map sits (a
    # forker's potential shared by the layers): qk_parameters() finds it by its class
    model = build('diff+coupled')
    model.shared = Hamiltonian(4, 8, 12, 1)
    decays, qk = decayed(model), {id(p) for p in model.qk_parameters()}
    wrong = [n for n, p in model.named_parameters() if (id(p) in decays) != (p.dim() >= 2 and id(p) not in qk)]
    assert decays and not wrong and {id(p) for p in model.shared.parameters()} <= qk, wrong


@pytest.mark.parametrize('attn', TRANSFORMS)
def test_qk_decay_falls_on_the_declared_matrices_only(attn):
    # a map's matrices by role (what its modules name in `matrices`, nn.Linear weights): decayed with --qk_decay only
    for qk_decay in (False, True):
        model = build(attn, qk_decay=qk_decay)
        decays = decayed(model)
        for qk in qk_maps(model):
            declared = {id(getattr(m, n)) for m in qk.modules() for n in getattr(m, 'matrices', ())}
            declared |= {id(m.weight) for m in qk.modules() if isinstance(m, nn.Linear)}
            wrong = sorted(n for n, p in qk.named_parameters() if (id(p) in decays) != (qk_decay and id(p) in declared))
            assert not wrong, f"{attn} declares {len(declared)} matrices; qk_decay={qk_decay} decays wrong: {wrong}"


# ---------------------------------------------------------------------------------------------------------------
# the coupling diagnostic: how much of the q/k map is beyond what W_q, W_k could absorb

def diagnose(model):  # 256 tokens: above the nonlinear fit's floor at hs = 8 (8 x 17 unknowns)
    return qk_diagnostics(model, idx_batch(B=16, T=16))


def test_diagnostic_reads_zero_at_dt_zero_a_linear_potential_as_linear_and_a_curved_one_as_nonlinear():
    still = build('coupled', qk_scale=2.0)
    with torch.no_grad():
        for qk in qk_maps(still):
            qk.dt.zero_()
    assert all(s['dq'] == 0 and s['dk'] == 0 and s['nonlinear'] < 1e-12 for s in diagnose(still))
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
    assert len(stats) == 2


@pytest.mark.parametrize('attn', TRANSFORMS)
def test_diagnostic_covers_every_q_k_transform(attn):
    model = build(attn)
    randomize_qk(model)
    stats = diagnose(model)
    assert len(stats) == 2 and all(s['nonlinear'] > 0 for s in stats)
    for s, qk in zip(stats, qk_maps(model)):  # every learned per-head scalar it declares, by name
        assert all(s[name] == getattr(qk, name).flatten().tolist() for name in getattr(qk, 'scalars', ()))


@pytest.mark.parametrize('n_head', [8, 4])  # 256 wide: hs = 32 (the tiny preset's heads), hs = 64 (60m's)
def test_nonlinear_fraction_has_a_floor_and_reads_near_its_8192_token_value_above_it(n_head):
    # the affine fit has 2 hs + 1 unknowns per output: on about as many tokens it fits anything. From FIT_TOKENS
    # distinct tokens per unknown it is within 8% of its value on 8,192 tokens (a least-squares residual shrinks as
    # sqrt(1 - unknowns / tokens)); below that floor, None
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
    assert nonlinear(idx[:1].repeat(128, 1)) is None  # 64 distinct tokens (rope's layer 0 sees no position): too few
    stats = qk_diagnostics(model, idx[:2])[0]
    assert stats['nonlinear'] is None and stats['dq'] > 0  # dq, dk need no fit
    both = [stats, qk_diagnostics(model, idx)[0]]  # a layer without a value is left out of the median
    assert M.median_layer(both, 'nonlinear') == both[1]['nonlinear']
    assert M.median_layer([stats], 'nonlinear') is None


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
    # the q, k at the hook `scored` (after the q/k map and rotary) give the P that mixes v
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
    # sigma_2 / sigma_1 within 1e-3 of the exact one
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
    # 60m's heads at block 512 on the recipe's eval batch of 32: the model sees 8 sequences, the largest tensor is a
    # layer's (8, 8, 512, 512) float32 probabilities, and every singular value decomposition is of a (512, 8) block
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
    # a forker's first edit, a force of their own: doubling F is doubling the potential's a, in loss and gradients
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


SHIPPED = ('coupled', 'euler', 'symplectic-euler', 'euler-mlp', 'coupled-mlp', 'uncoupled', 'invertible')


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
    with torch.autocast('cpu', dtype=torch.bfloat16):  # (diff+name's map)
        dtypes = {str(x.dtype) for x in qk(*torch.randn(2, 2, 4, 16, 8).bfloat16())}
    if dtypes != {'torch.bfloat16'}:  # float32 q', k' cost speed: held in the maps this repository ships, else warned
        said = (f"{name} returns {dtypes} q and k for bf16 ones under bf16 autocast: its work and memory are float32's "
                "(cast its parameters to q.dtype, as Hamiltonian casts dt)")
        assert name not in SHIPPED, said
        warnings.warn(said)
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
    assert 0.8 * counted <= priced <= 1.25 * counted, \
        f"{name} prices its elementwise work at {priced} FLOPs a token and head; {counted} are counted"


