"""
A GPT with coupled query-key dynamics (Gahtan & Bronstein, arXiv 2604.01683), nanoGPT-shaped. `attn` picks the
attention: standard, diff (Ye et al. 2024), a QK_TRANSFORMS entry (coupled is the paper's), or diff+<entry>.
"""

import inspect
import math
import os
import statistics
from contextlib import suppress
from dataclasses import dataclass
from collections import namedtuple

import torch
import torch.nn as nn
from torch.nn import functional as F

POS = ('learned', 'rope')
PRESETS = {'tiny': dict(n_layer=4, n_head=4, n_embd=128), 'small': dict(n_layer=6, n_head=6, n_embd=384),  # laptops
           '60m': dict(n_layer=12, n_head=8, n_embd=512), '150m': dict(n_layer=16, n_head=12, n_embd=768),
           '350m': dict(n_layer=24, n_head=16, n_embd=1024)}  # the paper's scales: our guess at shapes


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257  # GPT-2 tokenizer
    n_layer: int = 12
    n_head: int = 8
    n_embd: int = 512
    dropout: float = 0.0
    bias: bool = False       # biases in Linears and LayerNorms (GPT-2: True)
    attn: str = 'standard'   # one of attn_names(): standard, diff, or [diff+]<a QK_TRANSFORMS entry>
    qk_steps: int = 1        # steps of the q/k map
    qk_hidden: int = 12      # width m of coupled's potential V; each entry's width(m) derives its own
    qk_scale: float = 2.0    # spread of the q/k nets' pre-activations at init, out of SiLU's straight range
    qk_dt: float = 0.1       # initial step size dt (learned per head)
    qk_decay: bool = False   # weight decay on the q/k nets' matrices too
    pos: str = 'learned'     # 'learned' absolute positions, or 'rope' (applied after the q/k dynamics)

    def __post_init__(self):  # a mistake a user makes by flag: a one-line error each
        for name, known in (('attn', attn_names()), ('pos', POS)):
            if getattr(self, name) not in known:
                raise ValueError(f"{name}={getattr(self, name)!r} is unknown; choose one of {', '.join(known)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        assert not self.diff or self.n_head % 2 == 0, "diff pairs heads into sub-heads: n_head must be even"
        assert self.pos != 'rope' or self.n_embd // self.n_head % 2 == 0, "rope rotates pairs: an even head size"

    @property
    def diff(self):  # 'diff' or 'diff+<entry>'
        return self.attn.split('+')[0] == 'diff'

    @property
    def qk_name(self):  # the QK_TRANSFORMS entry of [diff+]<entry>, '' for none
        return qk_name(self.attn)


# ----------------------------------------------------------------------------------------------------------------
# q/k transforms. Each maps q, k of shape (B, nh, T, hs) per head and per token: positions never mix.

class Table(dict):  # an unknown name is an error, never a default; a taken one is refused
    def __init__(self, entries, what):
        super().__init__(entries)
        self.what = what  # what a name names

    def __missing__(self, name):
        raise ValueError(f"{self.what} {name!r} is unknown; choose one of {', '.join(self)}")

    def __setitem__(self, name, value):  # `del TABLE[name]` first to replace a built-in on purpose
        if name in self:
            raise ValueError(f"{self.what} {name!r} is taken; give yours another name")
        super().__setitem__(name, value)


class HeadMLP(nn.Module):
    """A separate two-layer SiLU net per head: x (..., nh, N, d_in) -> a silu(W x + b), (..., nh, N, d_out)."""
    matrices = ('W', 'a')  # what --qk_decay decays (never b)

    def __init__(self, n_head, d_in, hidden, d_out, zero_out=False, w_std=None):
        super().__init__()
        self.W = nn.Parameter(torch.randn(n_head, hidden, d_in) * (w_std or 1 / math.sqrt(d_in)))  # (nh, m, d_in)
        self.b = nn.Parameter(torch.zeros(n_head, 1, hidden))                                      # (nh, 1, m)
        self.a = nn.Parameter(torch.zeros(n_head, d_out, hidden) if zero_out                        # (nh, d_out, m)
                              else torch.randn(n_head, d_out, hidden) / math.sqrt(hidden))

    def pre(self, x):  # pre-activation z = W x + b: (..., nh, N, d_in) @ (nh, d_in, m) -> (..., nh, N, m)
        z = x @ self.W.transpose(1, 2)
        return z + self.b.to(z.dtype)  # z stays in the matmul's dtype (bf16 under autocast)

    def forward(self, x, scale=1.0):  # scale (e.g. a step size, (nh, 1, 1)) folded into the small a
        return F.silu(self.pre(x)) @ (scale * self.a).transpose(1, 2)


def silu_grad(z):  # silu'(z) = s (1 + z (1 - s)), s = sigmoid(z)
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


class Potential(HeadMLP):
    """Our reading: F(q) = -grad V(q), V(q) = sum_j a_j silu(w_j . q + b_j) per head (w_j: the rows of W)."""
    gradient = True
    # two matmuls of m hs multiply-adds (W q, then . W); per unit + b, silu' (5 ops) and * a
    flops = staticmethod(lambda hs, m: (4 * m * hs, 7 * m))

    def __init__(self, n_head, head_size, hidden, w_std=None):
        super().__init__(n_head, head_size, hidden, 1, w_std=w_std)  # W (nh, m, hs), b (nh, 1, m), a (nh, 1, m)

    def V(self, q):  # the potential, (..., nh, N, hs) -> (..., nh, N)
        return super().forward(q).squeeze(-1)

    def forward(self, q, scale=1.0):  # scale F(q) = -W^T (scale a * silu'(W q + b)): closed form, no autograd
        return (silu_grad(self.pre(q)) * (-scale * self.a)) @ self.W


class FreeForce(HeadMLP):
    """The review's f(q) = A silu(W q + b) per head, W: hs -> m, A: m -> hs (here a). Its Jacobian A diag(silu') W
    is not symmetric, so it is the gradient of nothing: under leapfrog volume is kept, but not symplecticity."""
    gradient = False
    flops = staticmethod(lambda hs, m: (4 * m * hs, 2 * m))  # W q, A (.), + b, silu

    def __init__(self, n_head, head_size, hidden, w_std=None):
        super().__init__(n_head, head_size, hidden, head_size, w_std=w_std)  # W (nh, m, hs), b, A = a (nh, hs, m)
        # as strong as the potential's F at init (at spread 2, silu's rms is twice its derivative's)
        nn.init.normal_(self.a, std=(w_std or 1 / math.sqrt(head_size)) / (2 * math.sqrt(hidden)))


# Forces: cls(n_head, head_size, hidden, w_std=None); forward(q, scale) is scale F(q); gradient: F = -grad V;
# flops(hs, m): (matmul, elementwise) FLOPs of a call per token and head, m hidden units
FORCES = Table({'potential': Potential, 'mlp': FreeForce}, 'force')


# Integrators: step(h, q, k, dt) -> (q, k), one step of size dt for the Hamiltonian h; h.force(q, c) = c F(q)

def leapfrog(h, q, k, dt):  # kick-drift-kick: two forces a step
    k = k + h.force(q, dt / 2)  # kick:  k += dt/2 F(q)
    q = q + dt * k              # drift: q += dt k
    k = k + h.force(q, dt / 2)  # kick:  k += dt/2 F(q)
    return q, k


def euler(h, q, k, dt):  # explicit Euler, both from the old state: q, k = q + dt k, k + dt F(q)
    return q + dt * k, k + h.force(q, dt)


def symplectic_euler(h, q, k, dt):
    k = k + h.force(q, dt)  # kick:  k += dt F(q)
    return q + dt * k, k    # drift: q += dt k (the new k)


# Promises for a gradient force (symplectic: J^T Omega J = Omega; volume_preserving: det J = 1; symmetric: -dt
# returns; order p: error ~ dt^p); cost a step: forces, and vector_ops elementwise ops on hs numbers
Integrator = namedtuple('Integrator', 'step symplectic volume_preserving symmetric order forces vector_ops')
INTEGRATORS = Table({
    'leapfrog': Integrator(leapfrog, True, True, True, order=2, forces=2, vector_ops=4),
    'euler': Integrator(euler, False, False, False, order=1, forces=1, vector_ops=3),
    'symplectic-euler': Integrator(symplectic_euler, True, True, False, order=1, forces=1, vector_ops=3),
}, 'integrator')


class Hamiltonian(nn.Module):
    """Query = position, key = momentum: per head q'' = F(q), F a FORCES entry (a potential's: H = 1/2 |k|^2 + V(q)),
    stepped by an INTEGRATORS entry with a step size dt learned per head."""
    scalars = ('dt',)  # learned per-head scalars, which qk_diagnostics reports

    def __init__(self, n_head, head_size, hidden, steps, integrator='leapfrog', dt=0.1, w_std=None, force='potential'):
        super().__init__()
        self.f = FORCES[force](n_head, head_size, hidden, w_std=w_std)
        self.dt = nn.Parameter(torch.full((n_head,), float(dt)))
        self.integrate = INTEGRATORS[integrator].step  # an unknown name fails here
        self.steps, self.integrator = steps, integrator

    def force(self, q, scale=1.0):  # scale F(q); a subclass may change it (exercise 1)
        return self.f(q, scale)

    def step(self, q, k, dt):  # a subclass may change it too
        return self.integrate(self, q, k, dt)  # a plain function kept on the module: self is its h

    def forward(self, q, k, dt=None):
        B, nh, T, hs = q.shape
        dt = (self.dt if dt is None else dt).view(nh, 1, 1).to(q.dtype)  # under autocast q, k stay bf16
        # (B, nh, T, hs) -> (nh, B*T, hs): the force is one batched matmul
        q, k = (x.transpose(0, 1).reshape(nh, B * T, hs) for x in (q, k))
        for _ in range(self.steps):
            q, k = self.step(q, k, dt)
        return tuple(x.view(nh, B, T, hs).transpose(0, 1) for x in (q, k))  # (B, nh, T, hs)


class Uncoupled(nn.Module):
    """Matched-capacity baseline: q += dt g_q(q), k += dt g_k(k); each stream sees only itself."""
    scalars = ('dt',)

    def __init__(self, n_head, head_size, hidden, steps, dt=0.1, w_std=None):
        super().__init__()
        self.g_q = HeadMLP(n_head, head_size, hidden, head_size, w_std=w_std)
        self.g_k = HeadMLP(n_head, head_size, hidden, head_size, w_std=w_std)
        self.dt = nn.Parameter(torch.full((n_head,), float(dt)))
        self.steps = steps

    def forward(self, q, k):
        dt = self.dt.view(-1, 1, 1).to(q.dtype)
        for _ in range(self.steps):
            q, k = q + self.g_q(q, dt), k + self.g_k(k, dt)       # q += dt g_q(q); k += dt g_k(k)
        return q, k


class Invertible(nn.Module):
    """RealNVP-style coupling of q and k, identity at init: k <- k exp(s1(q)) + t1(q); q <- q exp(s2(k)) + t2(k)."""

    def __init__(self, n_head, head_size, hidden, steps, w_std=None):
        super().__init__()
        self.st1 = HeadMLP(n_head, head_size, hidden, 2 * head_size, zero_out=True, w_std=w_std)  # q -> (s1, t1)
        self.st2 = HeadMLP(n_head, head_size, hidden, 2 * head_size, zero_out=True, w_std=w_std)  # k -> (s2, t2)
        self.steps = steps

    @staticmethod
    def scale_shift(net, x):  # bounded log-scale s = tanh(.) keeps exp(s) in [1/e, e]
        s, t = net(x).chunk(2, dim=-1)
        return torch.tanh(s), t

    def forward(self, q, k):
        for _ in range(self.steps):
            s1, t1 = self.scale_shift(self.st1, q)
            k = k * torch.exp(s1) + t1                            # k = k exp(s1(q)) + t1(q)
            s2, t2 = self.scale_shift(self.st2, k)
            q = q * torch.exp(s2) + t2                            # q = q exp(s2(k)) + t2(k)
        return q, k


# An entry of QK_TRANSFORMS: what --attn=[diff+]<name> builds, one module per layer.
#   cls(n_head, head_size, **args(config), ...): the module; it initializes itself, and gets the QK_FLAGS it names
#   width(m): its hidden width, from --qk_hidden's m
#   flops(hs, width, steps): (matmul, elementwise) FLOPs per token and head; None: no price
#   symplectic, volume_preserving, symmetric, order (None: no claim), identity_at_zero: what `pytest -k <name>` checks
QKTransform = namedtuple('QKTransform', 'cls args width flops symplectic volume_preserving symmetric order '
                                        'identity_at_zero')


def dynamics(integrator, force='potential', width=lambda m: m, cls=None, **promises):
    """The entry of a Hamiltonian (or cls, a subclass) stepped by INTEGRATORS[integrator] under FORCES[force]. Its
    promises are the integrator's (symplectic: if the force is a gradient), unless given."""
    it, f = INTEGRATORS[integrator], FORCES[force]
    price = lambda hs, m, n: (n * it.forces * f.flops(hs, m)[0],  # n steps of forces and vector ops
                              n * (it.forces * f.flops(hs, m)[1] + it.vector_ops * hs))
    promised = dict(flops=price if f.flops else None, symplectic=it.symplectic and f.gradient, order=it.order,
                    volume_preserving=it.volume_preserving, symmetric=it.symmetric, identity_at_zero=True)
    args = lambda c: dict(integrator=integrator, force=force)
    return QKTransform(cls or Hamiltonian, args, width, **promised | promises)


QK_TRANSFORMS = Table({
    'coupled': dynamics('leapfrog'),  # the paper's method, our reading
    'euler': dynamics('euler'),
    'symplectic-euler': dynamics('symplectic-euler'),
    # the review's free force; width h = m/2 matches coupled's count
    'euler-mlp': dynamics('euler', 'mlp', width=lambda m: max(1, m // 2)),  # exactly the review's equation
    'coupled-mlp': dynamics('leapfrog', 'mlp', width=lambda m: max(1, m // 2)),
    # h = m/4 matches coupled's parameters; Euler for q' = g_q(q), k' = g_k(k): order 1. A step: two nets, each two
    # matmuls of h hs multiply-adds, + b and silu (2 h), and the add (hs)
    'uncoupled': QKTransform(Uncoupled, lambda c: {}, lambda m: max(1, m // 4),
                             lambda hs, h, n: (n * 8 * h * hs, n * (4 * h + 2 * hs)), symplectic=False,
                             volume_preserving=False, symmetric=False, order=1, identity_at_zero=True),
    # h = 0.4 m: v2's "about 0.3%" parameters at 60m. No dt: the identity at init. A step: two nets, each W (hs -> h)
    # and a (h -> 2 hs), + b and silu (2 h), and tanh, exp, * and + on hs numbers (4 hs)
    'invertible': QKTransform(Invertible, lambda c: {}, lambda m: max(1, round(0.4 * m)),
                              lambda hs, h, n: (n * 12 * h * hs, n * (4 * h + 8 * hs)), symplectic=False,
                              volume_preserving=False, symmetric=False, order=None, identity_at_zero=False),
}, 'q/k transform')


def attn_names():  # every --attn value, read from the table when asked (an entry added later counts)
    return ('standard', *QK_TRANSFORMS, 'diff', *('diff+' + t for t in QK_TRANSFORMS))


QK_FLAGS = dict(hidden='qk_hidden', steps='qk_steps', dt='qk_dt', w_std='qk_scale')  # argument: the flag it reads


def takes(cls):  # the QK_FLAGS arguments cls's constructor names (all, with **kwargs)
    params = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return set(QK_FLAGS)
    return set(QK_FLAGS) & set(params)


def qk_name(attn):  # the QK_TRANSFORMS entry of --attn=[diff+]<entry>, '' for none
    name = attn.split('+')[-1]
    return '' if name in ('standard', 'diff') else name


def qk_flags_read(attn):
    # the q/k flags --attn=attn reads: its map's QK_FLAGS, and --qk_decay. train.py and bench.py refuse the others
    return {QK_FLAGS[a] for a in takes(QK_TRANSFORMS[qk_name(attn)].cls)} | {'qk_decay'} if qk_name(attn) else set()


def qk_transform(name, n_head, head_size, config):
    # One layer's q/k map over n_head (sub-)heads. q, k start with spread 0.02 sqrt(n_embd): W of std
    # qk_scale / (0.02 sqrt(n_embd hs)) gives pre-activations w . q of spread qk_scale
    spec = QK_TRANSFORMS[name]
    w_std = config.qk_scale / (0.02 * math.sqrt(config.n_embd * head_size)) if config.qk_scale > 0 else None
    flags = dict(hidden=spec.width(config.qk_hidden), steps=config.qk_steps, dt=config.qk_dt, w_std=w_std)
    # each class gets the flags its constructor names: invertible names no dt, so --qk_dt is refused for it
    return spec.cls(n_head, head_size, **{k: flags[k] for k in takes(spec.cls)}, **spec.args(config))


# ----------------------------------------------------------------------------------------------------------------

class Rotary(nn.Module):
    """Rotary position embedding (RoFormer), rotate-half form: after the q/k dynamics."""

    def __init__(self, head_size, block_size, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2).float() / head_size)
        freqs = torch.outer(torch.arange(block_size).float(), inv_freq)           # (block_size, hs/2)
        self.register_buffer('cos', freqs.cos().repeat(1, 2), persistent=False)  # (block_size, hs)
        self.register_buffer('sin', freqs.sin().repeat(1, 2), persistent=False)

    def forward(self, x, start):  # x: (B, nh, T, hs), positions start .. start+T-1
        x1, x2, end = *x.chunk(2, dim=-1), start + x.size(2)
        cos, sin = self.cos[start:end].to(x.dtype), self.sin[start:end].to(x.dtype)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer_idx):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v of all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.SCALE_INIT = True
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout, self.layer_idx = config.n_head, config.n_embd, config.dropout, layer_idx
        self.head_size, self.diff = config.n_embd // config.n_head, config.diff
        self.n_v_head = config.n_head // 2 if self.diff else config.n_head  # diff: one v per pair of sub-heads
        self.qk = qk_transform(config.qk_name, config.n_head, self.head_size, config) if config.qk_name else None
        self.rotary = Rotary(self.head_size, config.block_size) if config.pos == 'rope' else None
        self.scored = nn.Identity()  # a hook point: the (q, k) scored (attention_diagnostics)
        if self.diff:  # reference: microsoft/unilm Diff-Transformer multihead_diffattn.py
            self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
            self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
                nn.Parameter(torch.randn(self.head_size) * 0.1) for _ in range(4))
            self.subln = nn.RMSNorm(2 * self.head_size, eps=1e-5)  # per-head norm of the (B, nh/2, T, 2hs) output

    def attend(self, q, k, v, past):
        # softmax(q k^T / sqrt(hs)) v over positions <= t; new queries sit at past..past+T-1 (one alone: no mask)
        T = q.size(2)
        mask = None if past == 0 or T == 1 else torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0 and T > 1,
                                              dropout_p=self.dropout if self.training else 0.0)

    # diff: one SDPA call per half of v (q, k, v of one head size: flash attention's condition), or per sub-head
    # with v at 2hs; equal outputs. None: split on CUDA only
    split_v = None

    def diff_attend(self, q, k, v, past):
        # (softmax(q1 k1^T) - lambda softmax(q2 k2^T)) v, lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init;
        # q, k: sub-heads 2i, 2i+1 (B, nh, T, hs); v: (B, nh/2, T, 2hs)
        lam = (torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
               - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2)) + self.lambda_init)
        q, k = (x.unflatten(1, (-1, 2)) for x in (q, k))  # (B, nh/2, 2, T, hs): [:, :, 0] is q1, k1; [:, :, 1] q2, k2
        split = q.is_cuda if self.split_v is None else self.split_v
        vs = v.chunk(2, dim=-1) if split else (v,)  # (B, nh/2, T, hs) twice, or (B, nh/2, T, 2hs)
        attend = lambda i: torch.cat([self.attend(q[:, :, i], k[:, :, i], vh, past) for vh in vs], dim=-1)
        y = attend(0) - lam * attend(1)  # softmax(q1 k1^T) v - lam softmax(q2 k2^T) v: (B, nh/2, T, 2hs)
        return self.subln(y.float()).type_as(y) * (1 - self.lambda_init)  # the norm in float32

    def forward(self, x, cache=None):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        past = 0 if cache is None else cache.sizes[self.layer_idx]
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_v_head, C // self.n_v_head).transpose(1, 2)  # (B, nh, T, hs); diff (B, nh/2, T, 2hs)
        if self.qk is not None:
            q, k = self.qk(q, k)  # the paper's step: evolve each token's (q, k) jointly
        if self.rotary is not None:
            q, k = self.rotary(q, past), self.rotary(k, past)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # the keys and values of every token so far
        q, k = self.scored((q, k))
        y = self.diff_attend(q, k, v, past) if self.diff else self.attend(q, k, v, past)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.SCALE_INIT = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config, verbose=True):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.pos == 'learned' else None,
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # outside the q/k maps: a q/k map initializes itself
        own = {id(m) for blk in self.transformer.h if blk.attn.qk is not None for m in blk.attn.qk.modules()}
        for module in self.modules():
            if id(module) not in own:
                self._init_weights(module)
        if verbose:
            n, n_qk = self.get_num_params(), sum(p.numel() for p in self.qk_parameters())
            print(f"parameters: {n / 1e6:.2f}M; attn={config.attn}; q/k maps add {n_qk:,} ({n_qk / (n - n_qk):.3%})")

    def get_num_params(self):  # the tied embedding once, positions included
        return sum(p.numel() for p in self.parameters())

    def qk_parameters(self):  # what coupling adds: the parameters of the QK_TRANSFORMS classes' modules
        classes = tuple(spec.cls for spec in QK_TRANSFORMS.values())
        return list({id(p): p for m in self.modules() if isinstance(m, classes) for p in m.parameters()}.values())

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            # scaled init of the residual projections, per GPT-2
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if getattr(module, 'SCALE_INIT', False) else 0.02
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) -> logits (B, T, vocab), loss (or None); with a KVCache, idx is the new tokens."""
        b, t = idx.size()
        past = 0 if cache is None else len(cache)
        assert past + t <= self.config.block_size, f"cannot forward {past + t} positions, block_size is only " \
                                                   f"{self.config.block_size}"
        x = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        if self.transformer.wpe is not None:
            x = x + self.transformer.wpe(torch.arange(past, past + t, device=idx.device))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, cache)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                                             ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # decay by role, not shape: Linear and Embedding weights, and what a module names in `matrices` (q/k nets:
        # only with qk_decay); never biases, gains, diff's lambdas or a per-head scalar
        qk_ids = {id(p) for p in self.qk_parameters()}
        roles = lambda m: ('weight',) if isinstance(m, (nn.Linear, nn.Embedding)) else getattr(m, 'matrices', ())
        matrices = {id(getattr(m, name)) for m in self.modules() for name in roles(m)}
        decay = lambda p: id(p) in matrices and (self.config.qk_decay or id(p) not in qk_ids)
        groups = [{'params': [p for p in self.parameters() if decay(p)], 'weight_decay': weight_decay},
                  {'params': [p for p in self.parameters() if not decay(p)], 'weight_decay': 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == 'cuda')

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """Extend idx (B, T) by max_new_tokens tokens (temperature=0: the most likely), with a KV cache."""
        bs, cache = self.config.block_size, None
        for _ in range(max_new_tokens):
            if cache is not None and len(cache) < bs:  # one new token
                logits, _ = self(idx[:, -1:], cache=cache)
            else:  # the last block_size tokens from scratch
                cache = KVCache(self.config.n_layer) if use_cache else None
                logits, _ = self(idx[:, -bs:], cache=cache)
            logits = logits[:, -1, :]
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float('Inf')
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


class KVCache:
    """Per layer, the (evolved, rotated) keys and values of every token so far, in buffers that double."""

    def __init__(self, n_layer):
        self.layers = [None] * n_layer  # (keys, values) buffers, (B, nh, capacity, hs)
        self.sizes = [0] * n_layer

    def __len__(self):  # tokens cached (by the first layer)
        return self.sizes[0]

    def update(self, i, k, v):  # append this step's (B, nh, T, hs) keys/values, return all of them
        n, T = self.sizes[i], k.size(2)
        if self.layers[i] is None or n + T > self.layers[i][0].size(2):
            grown = [x.new_empty(x.shape[:2] + (2 * (n + T),) + x.shape[3:]) for x in (k, v)]
            for new, old in zip(grown, self.layers[i] or ()):
                new[:, :, :n] = old[:, :, :n]
            self.layers[i] = grown
        keys, values = self.layers[i]
        keys[:, :, n:n + T], values[:, :, n:n + T] = k, v
        self.sizes[i] = n + T
        return keys[:, :, :n + T], values[:, :, :n + T]


class Seen(Exception):  # every watched module has given its output
    pass


def seen_by(model, idx, modules):
    """[(module, its inputs, its output)] of each module (called once) in model(idx), eval mode, in call order; the
    forward stops there."""
    seen, training = [], model.training

    def hook(mod, inp, out):
        seen.append((mod, inp, out))
        if len(seen) == len(modules):
            raise Seen
    hooks = [m.register_forward_hook(hook) for m in modules]
    try:
        with suppress(Seen):
            model.eval()(idx)
    finally:
        for h in hooks:
            h.remove()
        model.train(training)
    return seen


# the affine fit's 2 hs + 1 unknowns need FIT_TOKENS distinct tokens each (else nonlinear is None; at 8 it reads ~6%
# low: a residual shrinks like sqrt(1 - unknowns / tokens))
FIT_TOKENS = 8


@torch.no_grad()
def qk_diagnostics(model, idx):
    """Per layer, how far and how nonlinearly its q/k map moves tokens idx (B, T): dq = |q' - q| / |q|, dk alike,
    nonlinear = |(q', k') - best affine fit A (q, k) + c| / |(q, k)|, and the map's `scalars` (dt)."""
    maps = [blk.attn.qk for blk in model.transformer.h if blk.attn.qk is not None]
    if not maps:
        return []
    stats, rel = [], lambda a, b: ((a - b).norm() / b.norm()).item()
    for mod, (q, k), (q1, k1) in seen_by(model, idx, maps):  # (B, nh, T, hs) -> per head (nh, N, 2 hs), float64
        x, y = (torch.cat(p, -1).double().transpose(0, 1).flatten(1, 2) for p in ((q, k), (q1, k1)))
        x1 = torch.cat((x, torch.ones_like(x[..., :1])), -1)           # affine: [q, k, 1], (nh, N, 2 hs + 1)
        Q, R = torch.linalg.qr(x1)                                     # x1 = Q R: Q spans what an affine map reaches
        resid = y - Q @ (Q.transpose(1, 2) @ y)                        # y less its least-squares fit, (nh, N, 2 hs)
        sv, unknowns = torch.linalg.svdvals(R), x1.size(-1)            # x1's singular values, (nh, 2 hs + 1)
        full_rank = bool((sv[:, -1] > sv[:, 0] * x1.size(1) * torch.finfo(sv.dtype).eps).all())
        distinct = torch.unique(x.transpose(0, 1).flatten(1), dim=0).size(0)  # tokens whose (q, k) differ
        fits = full_rank and distinct >= FIT_TOKENS * unknowns
        hs = q.size(-1)
        stats.append(dict(dq=rel(y[..., :hs], x[..., :hs]), dk=rel(y[..., hs:], x[..., hs:]),
                          nonlinear=(resid.norm() / x.norm()).item() if fits else None))
        stats[-1].update({name: getattr(mod, name).flatten().tolist() for name in getattr(mod, 'scalars', ())})
    return stats


def attention_probs(q, k, dtype=torch.float32):  # softmax(q k^T / sqrt(hs)) over positions <= t: (B, nh, T, T)
    T = q.size(2)
    att = q.to(dtype) @ k.to(dtype).transpose(-2, -1) / math.sqrt(q.size(-1))
    return att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), -math.inf).softmax(-1)


def top_singular_values(a, n=2, block=8, iters=10):
    """sigma_1 .. sigma_n of each a (..., T, T) by subspace iteration on `block` vectors, x <- orth(a^T a x), then
    the singular values of a x: no (T, T) decomposition."""
    x = torch.randn(a.size(-1), min(block, a.size(-1)), generator=torch.Generator().manual_seed(0)).to(a)
    for _ in range(iters):
        x = torch.linalg.qr(a.transpose(-2, -1) @ (a @ x)).Q         # (..., T, block), orthonormal columns
    return torch.linalg.svdvals(a @ x)[..., :n]                      # (..., n), descending


def attention_stats(att):
    """Causal attention att (..., T, T) in three means over rows i >= 1: entropy, over its maximum log(i + 1) (1:
    uniform); sink, the mass on position 0; and gap, sigma_2 / sigma_1 (0: rank one)."""
    rows, T = att[..., 1:, :], att.size(-1)                                           # rows i = 1 .. T-1
    log_n = torch.arange(2, T + 1, dtype=att.dtype, device=att.device).log()           # log(i + 1), (T-1,)
    entropy = -torch.special.xlogy(rows, rows).sum(-1) / log_n                         # -sum p log p, 0 log 0 = 0
    sigma = top_singular_values(att)                                                   # (..., 2), descending
    return dict(entropy=entropy.mean().item(), sink=rows[..., 0].mean().item(),
                gap=(sigma[..., 1] / sigma[..., 0]).mean().item())


DIAG_SEQUENCES = 8  # sequences the attention diagnostics read: (8, nh, T, T) float32 a layer


@torch.no_grad()
def attention_diagnostics(model, idx, sequences=DIAG_SEQUENCES):
    """Per layer, attention_stats of every (sub-)head's softmax on the first `sequences` rows of idx (B, T)."""
    if idx.size(1) < 2:  # no row i >= 1
        return []
    scored = seen_by(model, idx[:sequences], [blk.attn.scored for blk in model.transformer.h])
    return [attention_stats(attention_probs(*qk)) for _, _, qk in scored]


def median_layer(stats, key):  # the median over the layers that have a value (None: none has)
    values = [s[key] for s in stats if s[key] is not None]
    return statistics.median(values) if values else None


def diagnostics(model, idx):
    """Both diagnostics of idx (B, T) per layer, and the median layer's as train.py's eval line's tail."""
    qk, att = qk_diagnostics(model, idx), attention_diagnostics(model, idx)
    line = ''
    if qk:
        nonlinear = median_layer(qk, 'nonlinear')  # None: too few tokens to fit
        line += (f" | q/k map: nonlinear {'too few distinct tokens' if nonlinear is None else f'{nonlinear:.2%}'}, "
                 f"dq {median_layer(qk, 'dq'):.1%}, dk {median_layer(qk, 'dk'):.1%} (median layer)")
    if att:
        line += " | attention: entropy {:.2f}, sink {:.2f}, gap {:.2f} (median layer)".format(
            *(median_layer(att, k) for k in ('entropy', 'sink', 'gap')))
    return qk, att, line


# --------------------------------------------------------------------------------------------------------------
# FLOP model: what a perfect implementation pays per token of a training step (forward + backward = 3x forward)

def flops_per_token(config, T):
    C, L, nh, hs = config.n_embd, config.n_layer, config.n_head, config.n_embd // config.n_head
    matmul = 2 * (L * 12 * C * C + C * config.vocab_size)            # c_attn, c_proj, c_fc, mlp.c_proj; lm_head
    attend = L * 2 * T * C * (3 if config.diff else 2) / 2  # q k^T and (attention) v, causal half
    spec = QK_TRANSFORMS[config.qk_name] if config.qk_name else None
    if spec and spec.flops is None:
        raise ValueError(f"{config.qk_name} has no FLOP price (flops=None in its QK_TRANSFORMS entry): give it one")
    qk_flops = L * nh * sum(spec.flops(hs, spec.width(config.qk_hidden), config.qk_steps)) if spec else 0
    return 3 * (matmul + attend + qk_flops)


# Dense bf16 peak FLOP/s for MFU, by the name torch.cuda.get_device_name reports: NVIDIA's datasheets' bf16 "with
# sparsity", halved (B200: the HGX's 36 PFLOPS over 8; RTX: the architecture whitepapers' FP32-accumulate figure)
GPU_PEAK_FLOPS = {
    'NVIDIA L4': 121e12, 'NVIDIA L40': 181e12, 'NVIDIA L40S': 362e12, 'NVIDIA A10': 125e12,
    'NVIDIA A100-SXM4-40GB': 312e12, 'NVIDIA A100-SXM4-80GB': 312e12, 'NVIDIA A100-PCIE-40GB': 312e12,
    'NVIDIA A100 80GB PCIe': 312e12, 'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA H100 PCIe': 756e12,
    'NVIDIA H100 NVL': 835e12, 'NVIDIA H200': 989e12, 'NVIDIA H200 NVL': 835e12, 'NVIDIA H800': 989e12,
    'NVIDIA H800 PCIe': 756e12, 'NVIDIA B200': 2250e12, 'NVIDIA GeForce RTX 4090': 165e12,
    'NVIDIA GeForce RTX 3090': 71e12,
}


def peak_flops(device, dtype='bfloat16'):
    """MFU's peak: $GPU_PEAK_TFLOPS, else the table's (None: neither), the dense bf16 peak; float32 multiplies in
    TF32, at half of it."""
    if os.environ.get('GPU_PEAK_TFLOPS'):
        peak = float(os.environ['GPU_PEAK_TFLOPS']) * 1e12
    else:
        peak = GPU_PEAK_FLOPS.get(torch.cuda.get_device_name(device)) if str(device).startswith('cuda') else None
    return peak / 2 if peak and dtype == 'float32' else peak


def find_device(name='auto'):
    """--device: auto is the first of cuda, mps and cpu that is here; a device not here is a ValueError saying why."""
    here = dict(cuda=torch.cuda.is_available(), mps=torch.backends.mps.is_available(), cpu=True)
    if name.split(':')[0] in ('auto', 'cuda') and not here['cuda'] and torch.version.cuda \
            and os.path.exists('/dev/nvidia0'):  # an NVIDIA GPU that this torch cannot drive
        raise ValueError(f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, which this NVIDIA "
                         "driver does not run: pip install torch --index-url https://download.pytorch.org/whl/cu126 "
                         "(drivers 525 on), or --device=cpu")
    device = next(d for d in here if here[d]) if name == 'auto' else name
    if not here.get(device.split(':')[0]):
        raise ValueError(f"--device={name} is unknown, or not available here; use auto, cpu, cuda[:N] or mps")
    return device


def autocast_dtype(device):  # dtype=auto: bf16 where native, fp16 on older GPUs (T4, V100), float32 off CUDA
    if not str(device).startswith('cuda'):
        return 'float32'
    return 'bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16'
