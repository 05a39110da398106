"""
The tests' harness, shared by test_model.py, test_scripts.py, exercises/test_lab.py and results/test_results.py (pytest
reads this file first): every test's random start, a run of a script as a process of its own, the small corpus and
the small train.py they train on. It also turns a model.py that cannot be imported (the lab's template appended twice,
say) into one line, as the scripts do.
"""
import contextlib
import json
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


def pytest_configure(config):  # a model.py that stops with its one line (the lab's template appended twice): that line
    try:
        import model  # noqa: F401
    except SystemExit as e:
        pytest.exit(str(e.code), returncode=2)


@pytest.fixture(autouse=True)
def seeded():  # every test starts from the same random state, whatever ran before it (a fork's tests, any order)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, 'results'))  # results/report.py, for tabulate
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
    import report
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

def train(corpus, out_dir, *args, timeout=240, **kw):  # one train.py in a process of its own
    return run('train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}', *SMALL, *args, timeout=timeout, **kw)


def trains(corpus, out_dir, *args):  # train.py and its arguments, for run(), start(), scripts()
    return ('train.py', f'--data_dir={corpus}', f'--out_dir={out_dir}', *SMALL, *args)


def metrics(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, 'metrics.jsonl'))]


