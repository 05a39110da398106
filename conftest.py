"""
The tests' harness, shared by test_model.py, test_scripts.py, exercises/test_lab.py and results/test_results.py (pytest
reads this file first): every test's random start, a run of a script as a process of its own, the small corpus and
the small train.py they train on; then the mathematics' helpers of test_model.py and the lab (a q/k pair, a
Hamiltonian, a Jacobian, a table entry's claims measured). A model.py that cannot be imported (the lab's template
appended twice, say) ends the tests in its one line, as it ends the scripts.
"""
import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import prepare_data

try:
    import model as M
    STOPPED = ''
except SystemExit as e:  # a model.py that stops with its one line (the lab's template appended twice): pytest stops
    M, STOPPED = None, str(e.code)  # with that line, before a test or a helper below reads the model


def pytest_configure(config):
    if STOPPED:
        pytest.exit(STOPPED, returncode=2)


@pytest.fixture(autouse=True)
def seeded():  # every test starts from the same random state, whatever ran before it
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, 'results'))  # results/report.py, for tabulate
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish? \u00e9\u00e8\u2014 caf\u00e9\n") * 40


# Every run of a script is a process of its own, as `python script args` is: its own pid, argv, working folder,
# environment, stdout and stderr pipes, exit code and signals. On Linux it is forked by multiprocessing's fork
# server, a warm Python that has imported what the scripts import (torch, and the torch._dynamo that AdamW loads:
# seconds each), so a run costs a fork. Elsewhere, and where a run sets a PYTHON* variable (read only when an
# interpreter starts), it is a fresh interpreter.

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


def start(*argv, cwd=HERE, env=None, patch='', sigint_ignored=False):
    """`python *argv` (a script and its arguments, or -c code, or -m module), started; a Popen. patch: python code
    run first (e.g. to make the checkpoint write slow); sigint_ignored: as a shell's background job inherits it."""
    request = dict(argv=[os.fsdecode(a) for a in argv], cwd=str(cwd), env=env or {}, patch=patch,
                   sigint_ignored=sigint_ignored)
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


def main_of(capsys, main, *args):
    """A script's main(*args) in this process, ended as Python ends the script: (exit code, stdout, stderr, what main
    returned)."""
    result = None
    try:
        result, code = main(*args), 0
    except SystemExit as e:  # sys.exit('error: ...'): Python prints the line and exits with 1
        code = print(e.code, file=sys.stderr) or 1 if isinstance(e.code, str) else e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err, result


def tabulate(capsys, *folders):  # python results/report.py FOLDERS: (exit code, stdout, stderr)
    import report
    return main_of(capsys, report.main, [str(f) for f in folders])[:3]


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


SMALL = ['--n_layer=2', '--batch_size=4', '--block_size=32', '--eval_iters=2', '--log_interval=1', '--sample_tokens=0']


def trains(corpus, out_dir, *args):  # train.py and its arguments, for run(), start(), scripts()
    return ('train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}', *SMALL, *args)


def train(corpus, out_dir, *args, **kw):  # one train.py in a process of its own
    return run(*trains(corpus, out_dir, *args), **kw)


def metrics(out_dir, event=None):  # the run's log records (those of one event)
    log = [json.loads(line) for line in open(os.path.join(out_dir, 'metrics.jsonl'))]
    return [m for m in log if event in (None, m['event'])]


def checkpoint(out_dir):
    return torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=True)


# ---------------------------------------------------------------------------------------------------------------
# the mathematics' helpers, shared by test_model.py and the lab: tensors shaped (B, n_head, T, head_dim), float64

def qk_pair(B=2, nh=3, T=5, hs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64),
            torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64))


def hamiltonian(integrator, steps=1, hs=8, nh=3, seed=0, force='potential'):
    torch.manual_seed(seed)
    h = M.Hamiltonian(nh, hs, 6, steps, integrator, force=force).double()
    with torch.no_grad():
        h.dt.copy_(torch.tensor([0.3, -0.5, 0.8][:nh], dtype=torch.float64))
        h.f.a.mul_(3.0 if force == 'potential' else 3.0 * math.sqrt(hs))  # a strong force, so it matters
        h.f.b.normal_()
    return h


class Pendulum(getattr(M, 'Hamiltonian', object)):  # exercise 1's: V(q) = -cos(q), F(q) = -sin(q) (object: see M)
    def force(self, q, scale=1.0):
        return -scale * torch.sin(q)


def jacobian(h, hs, seed=3):  # J = d(q', k')/d(q, k) for one token of one head (nh=1, B=1, T=1): (2 hs, 2 hs)
    def f(x):
        q1, k1 = h(x[:hs].view(1, 1, 1, hs), x[hs:].view(1, 1, 1, hs))
        return torch.cat((q1.flatten(), k1.flatten()))
    x = torch.randn(2 * hs, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.functional.jacobian(f, x)


def jacobian_det(h, hs):
    return torch.linalg.det(jacobian(h, hs)).item()


def symplectic_error(J):  # |J^T Omega J - Omega|, Omega = [[0, I], [-I, 0]]: 0 for a symplectic map's Jacobian J
    hs = len(J) // 2
    omega = torch.zeros(2 * hs, 2 * hs, dtype=torch.float64)
    omega[:hs, hs:], omega[hs:, :hs] = torch.eye(hs), -torch.eye(hs)
    return (J.T @ omega @ J - omega).abs().max().item()


# A table entry's claims (fields of QK_TRANSFORMS, INTEGRATORS), measured on one head of its map: symplectic,
# J^T Omega J = Omega; volume_preserving, det J = 1; symmetric, a step of -dt undoes a step; order p, the error falls
# 2^p-fold as dt halves; identity_at_zero, dt = 0 moves nothing

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


def measure(make, claim, hs=4):  # (holds, what was measured) for a claim about the map make(steps) builds
    q, k = qk_pair(B=1, nh=1, T=3, hs=hs, seed=7)
    if claim in ('symplectic', 'volume_preserving'):
        Js = [jacobian(make(2), hs, seed) for seed in (3, 4)]
        if claim == 'volume_preserving':
            err = max(abs(torch.linalg.det(J).item() - 1) for J in Js)
            return err < 1e-10, f"|det J - 1| = {err:.1e}"
        err = max(symplectic_error(J) for J in Js)
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
    if isinstance(qk, M.Hamiltonian) and type(qk).step is M.Hamiltonian.step:
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
    """What refutes a claim ('' if nothing); a map without a step size dt can claim no symmetry, order or identity."""
    if claim in ('symmetric', 'order', 'identity_at_zero') and not hasattr(make(1), 'dt'):
        return f"{name} claims {claim}={claimed}, but has no step size dt to test it with" if claimed else ''
    if claim == 'order':
        return '' if claimed is None else order_failure(name, claimed, make)
    holds, what = measure(make, claim)
    return '' if holds == claimed else f"{name} claims {claim}={claimed}: {what}"


def assert_integrator_keeps(name, claim):  # INTEGRATORS[name] keeps its claim under the potential's force
    make = lambda steps: one_head(M.Hamiltonian(1, 4, 8, steps, name))  # noqa: E731
    failure = claim_failure(name, claim, getattr(M.INTEGRATORS[name], claim), make)
    assert not failure, failure


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


W1 = 1 / (2 - 2 ** (1 / 3))  # Yoshida's weights: three leapfrog steps of w1 dt, w0 dt, w1 dt make a 4th-order step
W0 = -2 ** (1 / 3) * W1


def yoshida(h, q, k, dt):  # three self-contained leapfrog steps: 6 forces, 12 vector ops a step
    q, k = M.leapfrog(h, q, k, W1 * dt)
    q, k = M.leapfrog(h, q, k, W0 * dt)
    return M.leapfrog(h, q, k, W1 * dt)
