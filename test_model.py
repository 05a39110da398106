"""
The executable spec of model.py: the mathematics each attention variant promises (METHOD.md), in pytest.
Run: python -m pytest -q
"""
import math

import pytest
import torch

from model import ATTN, PRESETS, QK_TRANSFORMS, GPT, GPTConfig, Hamiltonian, Invertible, KVCache, LeapfrogStep

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
        for n, p in model.named_parameters():
            if '.qk.' in n:
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
    named = [(n, p) for n, p in model.named_parameters() if '.qk.' in n]
    assert named
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
                qk.st1.c_proj.zero_()
                qk.st2.c_proj.zero_()
            else:
                qk.dt.zero_()
    idx = idx_batch()
    assert torch.equal(model(idx)[0], ref(idx)[0])
    # and the default initialization is not the identity for the integrators (the test above can fail)
    if not attn.endswith('invertible'):
        assert not torch.allclose(build(attn, seed=1)(idx)[0], ref(idx)[0], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the Hamiltonian dynamics, on their own: tensors shaped (B, n_head, T, head_dim)

def hamiltonian(integrator, steps=1, hs=8, nh=3, seed=0):
    torch.manual_seed(seed)
    h = Hamiltonian(nh, hs, 6, steps, integrator).double()
    with torch.no_grad():
        h.dt.copy_(torch.tensor([0.3, -0.5, 0.8][:nh], dtype=torch.float64))
        h.V.c_proj.mul_(3.0)  # a strong potential, so the force matters
        h.V.bias.normal_()
    return h


def qk_pair(B=2, nh=3, T=5, hs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64),
            torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64))


def test_closed_form_force_equals_autograd_gradient_of_potential():
    h = hamiltonian('leapfrog')
    q, _ = qk_pair()
    q.requires_grad_(True)
    (grad,) = torch.autograd.grad(h.potential(q).sum(), q)
    assert torch.allclose(h.force(q), -grad, atol=1e-12)
    assert grad.abs().max() > 1e-2
    scale = h.dt.view(-1, 1, 1)  # the integrators fold dt into the force's hidden layer: same as scaling after
    assert torch.allclose(h.force(q, scale), scale * h.force(q), atol=1e-12)


def test_fused_leapfrog_step_gradients_pass_gradcheck():
    # LeapfrogStep's hand-written backward against finite differences, for every input (float64)
    g = torch.Generator().manual_seed(0)
    nh, N, hs, m = 2, 5, 4, 3
    args = [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
            for shape in ((nh, N, hs), (nh, N, hs), (nh, m, hs), (nh, m, 1), (nh, m, 1), (nh, 1, 1))]
    assert torch.autograd.gradcheck(LeapfrogStep.apply, args)


@pytest.mark.parametrize('steps', [1, 3])
def test_fused_leapfrog_equals_the_readable_loop_in_values_and_gradients(steps):
    h = hamiltonian('leapfrog', steps)
    q, k = qk_pair()
    q.requires_grad_(True)
    k.requires_grad_(True)
    gq, gk = qk_pair(seed=1)
    results = []
    for fused in (True, False):
        h.fused = fused
        q1, k1 = h(q, k)
        grads = torch.autograd.grad((q1 * gq).sum() + (k1 * gk).sum(), [q, k] + list(h.parameters()))
        results.append((q1, k1) + grads)
    for a, b in zip(*results):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12, rtol=0)
    assert all(g.abs().max() > 1e-3 for g in results[0][2:])  # every gradient is there to compare


@pytest.mark.parametrize('attn', ['coupled', 'diff+coupled'])
def test_fused_leapfrog_in_the_model_equals_the_loop(attn):
    # q, k arrive as strided views of c_attn's output; the fused path must give the same loss and gradients
    model = build(attn)
    randomize_qk(model)
    idx = idx_batch()
    results = []
    for fused in (True, False):
        for qk in qk_maps(model):
            qk.fused = fused
        model.zero_grad()
        loss = model(idx, targets=idx)[1]
        loss.backward()
        results.append([loss] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_fused_leapfrog_under_bfloat16_autocast():
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


def jacobian_det(h, hs):
    """det d(q', k')/d(q, k) for one token of one head (nh=1, B=1, T=1), in float64."""
    def f(x):
        q1, k1 = h(x[:hs].view(1, 1, 1, hs), x[hs:].view(1, 1, 1, hs))
        return torch.cat((q1.flatten(), k1.flatten()))
    x = torch.randn(2 * hs, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return torch.linalg.det(torch.autograd.functional.jacobian(f, x)).item()


@pytest.mark.parametrize('steps', [1, 4])
def test_leapfrog_preserves_volume_and_euler_does_not(steps):
    hs = 4
    leap, euler = hamiltonian('leapfrog', steps, hs=hs, nh=1), hamiltonian('euler', steps, hs=hs, nh=1)
    assert abs(jacobian_det(leap, hs) - 1.0) < 1e-10
    assert abs(jacobian_det(euler, hs) - 1.0) > 1e-3


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
    cache = KVCache(model.config.n_layer, model.lm_head.weight)  # with generation's copy of the output embedding
    steps = [model(idx[:, :5], cache=cache)[0]]  # a prompt, then one token at a time
    steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 12)]
    assert len(cache) == 12
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    # a chunk of several new tokens on top of a cache is masked causally too
    cache = KVCache(model.config.n_layer)
    parts = [model(idx[:, :4], cache=cache)[0], model(idx[:, 4:12], cache=cache)[0]]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)
    # reset forgets the tokens, keeps the buffers: the same logits again
    cache.reset()
    assert len(cache) == 0 and torch.allclose(model(idx[:, :7], cache=cache)[0], full[:, :7], atol=1e-5)


def test_kv_cache_keeps_a_column_major_output_embedding_in_float32_only():
    model = build('standard').eval()
    w = model.lm_head.weight
    copy = KVCache(model.config.n_layer, w).lm_head  # read column by column by one-row products (see KVCache)
    assert torch.equal(copy, w) and copy.t().is_contiguous() and copy.data_ptr() != w.data_ptr()
    with torch.autocast('cpu', dtype=torch.bfloat16):  # autocast casts the weight once; a copy it would cast per token
        assert KVCache(model.config.n_layer, w).lm_head is None


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
    return m.get_num_params(), m.get_num_qk_params()


def test_coupling_adds_about_a_tenth_of_a_percent_at_60m():
    n_std, _ = count_60m('standard')
    n, n_qk = count_60m('coupled')
    assert n - n_std == n_qk and 55e6 < n_std < 70e6
    assert 0.0005 < n_qk / n_std < 0.003


@pytest.mark.parametrize('attn', ['uncoupled', 'euler', 'invertible'])
def test_baselines_match_coupled_capacity_at_60m(attn):
    _, coupled = count_60m('coupled')
    _, other = count_60m(attn)
    tolerance = 0.10 if attn != 'invertible' else 0.5  # invertible: v2's "about 0.3%" budget, stated separately
    assert abs(other - coupled) / coupled <= tolerance
    assert other / count_60m('standard')[0] < 0.003


@pytest.mark.parametrize('attn', ATTN)
def test_a_few_adamw_steps_lower_the_loss(attn):
    model = build(attn)
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), 'cpu')
    idx = idx_batch(B=4)
    first = None
    for _ in range(8):
        _, loss = model(idx[:, :-1], targets=idx[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model(idx[:, :-1], targets=idx[:, 1:])[1].item() < first - 0.2


def test_step_sizes_are_not_weight_decayed():
    model = build('coupled')
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    no_decay = {id(p) for g in opt.param_groups if g['weight_decay'] == 0 for p in g['params']}
    for n, p in model.named_parameters():
        assert (id(p) in no_decay) == (n.endswith(('.dt', 'bias')) or p.dim() < 2), n


# ===============================================================================================================
# the main job: prepare_data.py and train.py, run the way a user runs them

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

import prepare_data  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TIKTOKEN_CACHE = os.path.join(HERE, '..', 'shared', 'tiktoken_cache')
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish? \u00e9\u00e8\u2014 caf\u00e9\n") * 40


def run(script, *args, cwd=HERE, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    if os.path.isdir(TIKTOKEN_CACHE):
        env.setdefault('TIKTOKEN_CACHE_DIR', os.path.abspath(TIKTOKEN_CACHE))
    return subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_bin(path):
    return np.fromfile(path, dtype=np.uint16)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A small real corpus (Python's own docs, offline), prepared with the bytes tokenizer."""
    d = tmp_path_factory.mktemp('data')
    prepare_data.prepare('pydocs', data_dir=str(d))
    return str(d)


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
    assert json.load(open(out / 'meta.json'))['tokenizer'] == 'bytes'


def test_prepare_round_trip_gpt2_through_offline_cache(tmp_path, monkeypatch):
    if not os.path.isdir(TIKTOKEN_CACHE):
        pytest.skip('no ../shared/tiktoken_cache: the gpt2 tokenizer would need the network')
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', os.path.abspath(TIKTOKEN_CACHE))
    import tiktoken
    docs = [{'text': f"Abstract {i}: coupled dynamics of queries and keys, trial {i}.\n" * (i + 1)} for i in range(30)]
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


def test_prepare_failure_leaves_no_partial_output(tmp_path, monkeypatch):
    src = tmp_path / 'docs'
    src.mkdir()
    (src / 'a.jsonl').write_text('{"text": "one"}\n{"text": "two"}\n')
    prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path / 'data'))
    out = tmp_path / 'data' / 'docs'
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    # 1) corrupt input on a forced redo: one clear line, and the finished dataset is untouched
    (src / 'b.jsonl').write_text('{"text": "three"}\nnot json\n')
    r = run('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path / "data"}', '--force')
    assert r.returncode != 0 and 'Traceback' not in r.stderr
    assert r.stderr.strip().count('\n') == 0 and 'b.jsonl:2' in r.stderr
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    # 2) interrupted while writing tokens: no temp files, no half-written .bin, old meta still valid
    (src / 'b.jsonl').write_text('{"text": "three"}\n')
    real = prepare_data.write_tokens
    calls = []

    def write_then_interrupt(path, docs, tok):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, docs, tok)
    monkeypatch.setattr(prepare_data, 'write_tokens', write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.prepare(None, input=str(src), data_dir=str(tmp_path / 'data'), force=True)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    # 3) a failure on a fresh name leaves no directory behind
    r = run('prepare_data.py', f'--input={tmp_path / "missing.txt"}', f'--data_dir={tmp_path / "data"}')
    assert r.returncode != 0 and not (tmp_path / 'data' / 'missing').exists()


SMALL = ['--n_layer=2', '--batch_size=4', '--block_size=32', '--eval_iters=2', '--log_interval=1']


def train(corpus, out_dir, *args, timeout=240):
    return run('train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}', *SMALL, *args, timeout=timeout)


def metrics(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, 'metrics.jsonl'))]


def test_resume_continues_and_reproduces_the_uninterrupted_run(corpus, tmp_path):
    common = ['--max_iters=12', '--lr_decay_iters=12', '--warmup_iters=2', '--eval_interval=6', '--attn=coupled',
              '--dropout=0.1']
    a, b = tmp_path / 'a', tmp_path / 'b'
    assert train(corpus, a, *common).returncode == 0
    assert train(corpus, b, *common, '--max_iters=6').returncode == 0  # "interrupted" after 6 iterations
    r = train(corpus, b, *common, '--init_from=resume')
    assert r.returncode == 0 and 'resuming' in r.stdout and 'at iteration 6' in r.stdout
    trained = lambda d: {m['iter']: m['loss'] for m in metrics(d) if m['event'] == 'train'}
    ta, tb = trained(a), trained(b)
    assert sorted(tb) == list(range(1, 13))  # the count continued from 7, not from 1
    assert all(tb[i] == pytest.approx(ta[i], abs=1e-6) for i in range(7, 13))
    evals = lambda d: [m['val_loss'] for m in metrics(d) if m['event'] == 'eval' and m['iter'] == 12]
    assert evals(b)[0] == pytest.approx(evals(a)[0], abs=1e-6)
    ckpt = torch.load(b / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 12 and not any(k.startswith('_orig_mod.') for k in ckpt['model'])


def test_training_lowers_validation_loss_and_logs_progress(corpus, tmp_path):
    r = train(corpus, tmp_path, '--max_iters=40', '--eval_interval=20', '--attn=coupled', '--learning_rate=3e-3')
    assert r.returncode == 0
    line = [x for x in r.stdout.splitlines() if x.startswith('iter 40/40')][0]
    assert all(w in line for w in ('loss', 'lr', 'ms/iter', 'tok/s', 'eta'))
    vals = [m['val_loss'] for m in metrics(tmp_path) if m['event'] == 'eval']
    assert len(vals) == 3 and vals[-1] < vals[0] - 1.0


@pytest.mark.parametrize('args, words', [
    (['--attn=hamiltonian'], 'not one of'),
    (['--flux=3'], 'unknown flag --flux'),
    (['--batch_size=four'], 'expects an integer'),
    (['--dropout=zero'], 'expects a number'),
    (['--compile=maybe'], 'True or False'),
    (['--max_iters', '5'], '--key=value'),
    (['--preset=', '--n_head=3'], 'not divisible'),
    (['--attn=diff', '--preset=', '--n_head=1', '--n_embd=64'], 'even'),
    (['--qk_steps=9'], '1..7'),
    (['--block_size=10000000'], 'lower --block_size'),
    (['--dataset=nowhere'], 'prepare_data.py'),
    (['--init_from=resume'], 'no checkpoint'),
    (['--device=cuda'], 'CUDA is not available'),
])
def test_bad_flags_give_one_clear_line(corpus, tmp_path, args, words):
    if '--device=cuda' in args and torch.cuda.is_available():
        pytest.skip('CUDA is available here')
    r = train(corpus, tmp_path, *args)
    assert r.returncode != 0 and 'Traceback' not in r.stderr
    err = r.stderr.strip()
    assert err.startswith('error:') and '\n' not in err and words in err


def test_dropout_zero_is_a_valid_float(corpus, tmp_path):
    r = train(corpus, tmp_path, '--dropout=0', '--max_iters=1')
    assert r.returncode == 0


def test_bad_data_and_checkpoints_are_refused_clearly(corpus, tmp_path):
    # a truncated token file
    bad = tmp_path / 'data'
    os.makedirs(bad / 'pydocs')
    for f in ('meta.json', 'train.bin', 'val.bin'):
        (bad / 'pydocs' / f).write_bytes(open(os.path.join(corpus, 'pydocs', f), 'rb').read())
    with open(bad / 'pydocs' / 'train.bin', 'r+b') as f:
        f.truncate(1001)
    r = run('train.py', f'--data_dir={bad}', f'--out_dir={tmp_path}', '--max_iters=1')
    assert r.returncode != 0 and 'corrupt' in r.stderr and '\n' not in r.stderr.strip()
    # a checkpoint of another architecture
    out = tmp_path / 'out'
    assert train(corpus, out, '--max_iters=2', '--eval_interval=1', '--attn=coupled').returncode == 0
    r = train(corpus, out, '--init_from=resume', '--attn=diff')
    assert r.returncode != 0 and "attn='coupled' there but 'diff' here" in r.stderr
    # a corrupt checkpoint
    (out / 'ckpt.pt').write_bytes(b'not a checkpoint')
    r = train(corpus, out, '--init_from=resume')
    assert r.returncode != 0 and 'corrupt' in r.stderr and 'Traceback' not in r.stderr


def test_non_finite_loss_stops_the_run(corpus, tmp_path):
    r = train(corpus, tmp_path, '--max_iters=30', '--learning_rate=1e6', '--warmup_iters=0', '--grad_clip=0')
    assert r.returncode == 3
    assert 'at iteration' in r.stderr and ('nan' in r.stderr or 'inf' in r.stderr)


def test_time_budget_stops_the_run(corpus, tmp_path):
    r = train(corpus, tmp_path, '--max_iters=100000', '--time_budget=2', '--eval_interval=100000')
    assert r.returncode == 0
    last = metrics(tmp_path)[-1]
    assert last['event'] == 'eval' and 2 <= last['time'] < 10 and last['iter'] < 100000


def test_test_split_is_evaluated_at_the_end(corpus, tmp_path):
    d = tmp_path / 'data' / 'pydocs'
    os.makedirs(d)
    meta = json.load(open(os.path.join(corpus, 'pydocs', 'meta.json')))
    for f in ('train.bin', 'val.bin'):
        (d / f).write_bytes(open(os.path.join(corpus, 'pydocs', f), 'rb').read())
    (d / 'test.bin').write_bytes(open(os.path.join(corpus, 'pydocs', 'val.bin'), 'rb').read())
    meta['tokens']['test'] = meta['tokens']['val']
    (d / 'meta.json').write_text(json.dumps(meta))
    r = run('train.py', f'--data_dir={tmp_path / "data"}', f'--out_dir={tmp_path}', *SMALL, '--max_iters=2')
    assert r.returncode == 0 and 'test ppl' in r.stdout
    assert metrics(tmp_path)[-1]['event'] == 'test'


def test_ddp_two_cpu_ranks_see_different_batches_and_end_identical(corpus, tmp_path):
    r = run('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', '--device=cpu',
            f'--data_dir={corpus}', f'--out_dir={tmp_path}', *SMALL, '--max_iters=6', '--eval_interval=3',
            '--attn=coupled')
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'ddp check: 2 ranks, identical weights: True, distinct batches: True' in r.stdout
    assert '2 process(es)' in r.stdout


def test_compile_works_on_cpu(corpus, tmp_path):
    r = train(corpus, tmp_path, '--compile=True', '--max_iters=3', '--eval_interval=3', '--n_layer=1',
              '--attn=coupled', timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'compiling' in r.stdout and 'torch.compile failed' not in r.stdout
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert not any(k.startswith('_orig_mod.') for k in ckpt['model'])


# ---------------------------------------------------------------------------------------------------------------
# bench.py: records, not timings (timings are never asserted)

def test_bench_writes_one_record_per_variant_and_mode(tmp_path):
    out = tmp_path / 'bench.jsonl'
    r = run('bench.py', '--preset=tiny', '--attn=coupled,diff+coupled', '--vocab_size=64', '--batch_size=2',
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


@pytest.mark.parametrize('args, words', [(['--attn=hamiltonian'], 'hamiltonian'), (['--mode=backward'], 'backward'),
                                         (['--preset=huge'], 'preset')])
def test_bench_bad_flags_give_one_clear_line(args, words):
    r = run('bench.py', *args)
    assert r.returncode != 0 and words in r.stderr and 'Traceback' not in r.stderr and len(r.stderr.splitlines()) == 1
