"""
The scripts, run as a user runs them, each a process of its own (conftest.py starts them): prepare_data.py,
train.py and its promises (test_G1_...: no run lost; test_G2_...: exact resume; test_G3_...: never silently wrong;
test_G4_...: one clear line for a plausible mistake), DDP and signals, bench.py, and the repository's pages.
Run: python -m pytest -q
"""
import ast
import contextlib
import dataclasses
import glob
import gzip
import hashlib
import http.server
import json
import math
import os
import platform
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
import torch.nn.functional as F

import bench
import prepare_data
import model as M
from model import (PRESETS, GPT, GPTConfig, KVCache, attn_names, flops_per_token)

from conftest import (HERE, PREPARED, SMALL, TEXT, checkpoint, main_of, metrics, one_line_error, read_bin, run,
                      scripts, side_by_side, start, tabulate, train, trains)
from test_model import build, idx_batch, qk_maps, randomize_qk, tiny


# ---------------------------------------------------------------------------------------------------------------
# the harness: a run is what python gives a user

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
    (tmp_path / 'model.py').write_text('')  # not the fork server's model.py: the run imports this one
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


# ---------------------------------------------------------------------------------------------------------------
# prepare_data.py

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
    src.write_text(TEXT * 2)  # the same file, other text: refused, unless forced
    other, forced = scripts(('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path}'),
                            ('prepare_data.py', f'--input={src}', f'--data_dir={tmp_path}', '--force'))
    assert one_line_error(other, 'holds play prepared otherwise (input_sha256 differs); --force replaces it')
    assert forced.returncode == 0 and len(read_bin(tmp_path / 'play' / 'train.bin')) > len(TEXT) * 1.5


@pytest.mark.parametrize('docs', [['a' * 10_000, 'b\n' * 45_000], ['Title\n' + 'x' * 60_000], ['', 'word ' * 400],
                                  ['one line\n' * 500], ['same\n' * 100] * 40])
@pytest.mark.parametrize('val_fraction', [0.1, 0.3])
def test_splits_hold_val_fraction_of_the_text_within_the_tolerance(docs, val_fraction):
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


PINNED = {  # sha256 of the corpora's token files, as prepared since the README's and results/'s runs were made
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
    # WikiText comes split: its splits are the archive's files (the wikitext zip test below)
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
    (['nocorpus'], "unknown corpus 'nocorpus'; choose one of pydocs"), (['--input=missing.txt'], 'does not exist'),
    (['--input=bad.jsonl'], "bad.jsonl:2 is not a JSON object with a string field 'text'"),  # a user's own corpus
    (['--input=small.txt'], 'val split would hold only 30 tokens, too few to train or evaluate on (at least 64); '
                            'give more text or a larger --val_fraction'),
    (['--val_fraction=1.5'], '--val_fraction must be between 0 and 1'), (['--tokenizer=words'], "invalid choice"),
])
def test_G4_prepare_bad_input_gives_one_line(tmp_path, args, words):
    (tmp_path / 'bad.jsonl').write_text('{"text": "fine"}\n{"title": "no text"}\n')
    (tmp_path / 'small.txt').write_text('x' * 300)  # val: 29 bytes and its end of text, a tenth of 301 tokens
    r = run(os.path.join(HERE, 'prepare_data.py'), *args, f'--data_dir={tmp_path / "data"}', cwd=tmp_path)
    assert one_line_error(r, words), r.stderr
    assert not glob.glob(str(tmp_path / 'data' / '*' / 'meta.json'))


# The paper's other corpora, downloaded from a local server: fixtures in the files' formats

def pubmed_fixture():
    entries = {str(30000000 + i): dict(QUESTION=f"Does coupling help {i}?", CONTEXTS=[f"Background {i}. " * 20,
               f"Methods {i}: a trial of queries and keys. " * 10], LONG_ANSWER=f"Coupling helped in case {i}.",
               YEAR='2018') for i in range(40)}
    return json.dumps(entries).encode(), entries


def web_fixture():
    docs = [dict(text=f"Caf\u00e9 page {i}: buy {i} widgets today! Free shipping.\n" * (i % 7 + 3), url=f'http://x/{i}',
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
    assert sum(meta['bytes'].values()) == sum(len(t.encode()) for t in want)  # the text's UTF-8 bytes, for bits/byte
    assert (out / fn).read_bytes() == blob  # the download is kept next to the tokens
    # a file changed upstream fails the checksum, leaving nothing behind
    monkeypatch.setitem(prepare_data.CORPORA, name, dict(prepare_data.CORPORA[name], sha256='0' * 64))
    with pytest.raises(prepare_data.DataError, match='does not have the expected sha256'):
        prepare_data.prepare(name, data_dir=str(tmp_path / 'other'))
    assert not (tmp_path / 'other' / name / fn).exists() and not (tmp_path / 'other' / name / 'meta.json').exists()


def test_wikitext_zip_with_the_archives_layout_and_its_test_split_scored_at_the_end(tmp_path, server, monkeypatch):
    import zipfile
    url, www = server
    held_out = ' = Heading = \n\n Held out text . \n' * 50  # valid and test alike: their scores must agree
    with zipfile.ZipFile(www / 'wikitext-2-raw-v1.zip', 'w') as z:
        for split, text in (('train', ' = Train = \n\n A text to learn . \n' * 200), ('valid', held_out),
                            ('test', held_out)):
            z.writestr(f'wikitext-2-raw/wiki.{split}.raw', text)
    monkeypatch.setitem(prepare_data.CORPORA, 'wikitext2', dict(prepare_data.CORPORA['wikitext2'],
                                                                 url=f'{url}/wikitext-2-raw-v1.zip'))
    meta = prepare_data.prepare('wikitext2', data_dir=str(tmp_path / 'data'), tokenizer='bytes')
    assert set(meta['tokens']) == {'train', 'val', 'test'}
    val = read_bin(tmp_path / 'data' / 'wikitext2' / 'val.bin')
    assert bytes(val[:-1].astype(np.uint8)).decode() == held_out
    r = train(tmp_path / 'data', tmp_path / 'out', '--dataset=wikitext2', '--max_iters=2')
    final = metrics(tmp_path / 'out')[-1]
    assert r.returncode == 0 and 'full test split' in r.stdout, r.stderr
    assert final['test_loss'] == pytest.approx(final['val_loss'])


OFFLINE = '''
import urllib.request
def offline(*a, **k):
    raise OSError('no network')
urllib.request.urlopen = offline
'''


def test_G4_offline_a_named_corpus_fails_in_one_line_and_a_local_copy_works(tmp_path):
    r = run('prepare_data.py', 'pubmed', f'--data_dir={tmp_path / "data"}', patch=OFFLINE)
    assert one_line_error(r, '--input=<path to ori_pqal.json>'), r.stderr
    assert not (tmp_path / 'data' / 'pubmed' / 'meta.json').exists()
    blob, items = pubmed_fixture()
    (tmp_path / 'ori_pqal.json').write_bytes(blob)
    r = run('prepare_data.py', 'pubmed', f'--input={tmp_path / "ori_pqal.json"}', f'--data_dir={tmp_path / "data"}')
    assert r.returncode == 0 and 'is not byte for byte' in r.stdout  # a fixture, not the real file: said, then used
    assert json.load(open(tmp_path / 'data' / 'pubmed' / 'meta.json'))['corpus'] == 'pubmed'


# ---------------------------------------------------------------------------------------------------------------
# train.py, and the promise each test holds (G1 to G4: see the docstring)

@pytest.fixture(scope='module')
def resumed(corpus, tmp_path_factory):
    """coupled, trained 40 iterations in a; in b, 20 (as if stopped there), then resumed to 40."""
    d = tmp_path_factory.mktemp('resumed')
    common = ['--max_iters=40', '--lr_decay_iters=40', '--warmup_iters=10', '--eval_interval=20', '--attn=coupled',
              '--learning_rate=1e-3', '--dropout=0.1']
    a, b = side_by_side(trains(corpus, d / 'a', *common), trains(corpus, d / 'b', *common, '--max_iters=20'))
    return d, (a, b, run(*trains(corpus, d / 'b', *common, '--init_from=resume')))


def trained_model(out_dir):  # the model a run saved, for evaluation
    ckpt = checkpoint(out_dir)
    model = GPT(GPTConfig(**ckpt['model_args']), verbose=False)
    model.load_state_dict(ckpt['model'])
    return model.eval()


def test_G2_resume_continues_and_reproduces_the_uninterrupted_run(resumed):
    d, (ra, rb, r) = resumed
    a, b = d / 'a', d / 'b'
    assert ra.returncode == rb.returncode == 0, ra.stderr + rb.stderr
    assert r.returncode == 0 and 'resuming' in r.stdout and 'at iteration 20' in r.stdout
    trained = lambda d: {m['iter']: m['loss'] for m in metrics(d, 'train')}  # noqa: E731
    ta, tb = trained(a), trained(b)
    assert sorted(tb) == list(range(1, 41))  # the count continued from 21, not from 1
    assert all(tb[i] == pytest.approx(ta[i], abs=1e-6) for i in range(21, 41))
    evals = lambda d: [m['iter'] for m in metrics(d, 'eval')]  # noqa: E731
    assert evals(b) == evals(a) == [0, 20, 40]  # the log holds each eval once, in order
    final = lambda d: metrics(d, 'final')[-1]  # noqa: E731
    assert final(b)['val_loss'] == pytest.approx(final(a)['val_loss'], abs=1e-6)
    assert final(b)['tokens'] == final(a)['tokens'] == 40 * 4 * 32  # tokens trained, across the resume
    assert len(metrics(b, 'final')) == 2  # the 20-iteration run's result was kept
    assert checkpoint(b)['iter_num'] == 40 and checkpoint(b)['tokens'] == 40 * 4 * 32


def test_G3_every_validation_token_is_scored_once_as_an_independent_computation_does(corpus, resumed):
    d, (r, _, _) = resumed
    final, model = metrics(d / 'a', 'final')[0], trained_model(d / 'a')
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
    line = [x for x in r.stdout.splitlines() if x.startswith('full val split')][0]
    assert float(re.search(r'loss ([\d.]+)', line).group(1)) == pytest.approx(nats / count, abs=1e-4)
    assert 'bits per byte' in line


def test_training_lowers_validation_loss_and_logs_progress_the_coupling_and_attention(corpus, resumed):
    d, (r, _, _) = resumed
    assert r.returncode == 0
    line = [x for x in r.stdout.splitlines() if x.startswith('iter 40/40')][0]
    assert all(w in line for w in ('loss', 'lr', 'ms/iter', 'tok/s', 'eta')) and '| mfu' not in line  # CPU: no MFU
    first = [x for x in r.stdout.splitlines() if x.startswith('iter 1/40')][0]
    assert first.endswith(' | eta -') and re.search(r' \| eta [\d.]+ min$', line), (first, line)  # none from 1 step
    assert 'q/k map: nonlinear' in r.stdout
    evals = metrics(d / 'a', 'eval')
    assert len(evals) == 3 and evals[-1]['val_loss'] < evals[0]['val_loss'] - 1.0
    for e in evals:  # every eval logs the coupling diagnostic per layer, with the step sizes
        assert len(e['qk']) == 2 and all(len(s['dt']) == 4 and 0 <= s['nonlinear'] for s in e['qk'])
    # the attention diagnostics per layer: the saved model's on val's diagnostic batch (seed 10,000)
    step = [x for x in r.stdout.splitlines() if x.startswith('step 40:')][0]
    att = evals[-1]['attn']
    assert f"attention: entropy {np.median([s['entropy'] for s in att]):.2f}, sink " in step
    model, data = trained_model(d / 'a'), read_bin(os.path.join(corpus, 'pydocs', 'val.bin'))
    ix = torch.randint(len(data) - 32 - 1, (M.DIAG_SEQUENCES,), generator=torch.Generator().manual_seed(10_000))
    x = torch.stack([torch.from_numpy(data[i:i + 32].astype(np.int64)) for i in ix])
    assert att == [pytest.approx(s, abs=1e-6) for s in M.attention_diagnostics(model, x)]
    assert len(att) == 2 and att != evals[0]['attn']  # it moved with training
    assert all(0 <= s[k] <= 1 for e in evals for s in e['attn'] for k in s)


def test_G3_resume_eval_and_sample_take_the_checkpoints_settings_and_refuse_another_model_or_corpus(tmp_path):
    # a run of another shape on a corpus of its own (sx), then again(): resumed and evaluated with --out_dir alone
    data, out = tmp_path / 'data', tmp_path / 'out'
    for i, name in enumerate(('a.txt', 'b.txt', 'c.txt')):
        (tmp_path / name).write_text(TEXT[i:] * 3)
    fp = prepare_data.prepare(None, input=str(tmp_path / 'a.txt'), name='sx', data_dir=str(data))['fingerprint']
    prepare_data.prepare(None, input=str(tmp_path / 'c.txt'), name='sy', data_dir=str(data))
    again = lambda *a: ('train.py', f'--out_dir={out}', *a)  # noqa: E731
    r, resumed, ev = scripts(
        ('train.py', f'--data_dir={data}', '--dataset=sx', f'--out_dir={out}', '--n_layer=1', '--n_embd=48',
         '--n_head=3', '--block_size=40', '--batch_size=3', '--max_iters=4', '--eval_interval=2', '--eval_iters=1',
         '--attn=coupled'),
        again('--init_from=resume', '--max_iters=6'), again('--eval_only=True'))
    assert r.returncode == 0 and resumed.returncode == 0, r.stderr + resumed.stderr
    assert 'at iteration 4' in resumed.stdout and 'sx: 257 token vocabulary' in resumed.stdout
    assert checkpoint(out)['config']['block_size'] == 40
    assert checkpoint(out)['fingerprint'] == fp == metrics(out)[0]['fingerprint']
    n_val = json.load(open(data / 'sx' / 'meta.json'))['tokens']['val']
    assert ev.returncode == 0 and f"({n_val:,} tokens)" in ev.stdout  # sx's val split, not pydocs'
    # a model flag, a preset or a corpus not the checkpoint's: one line naming it, nothing touched
    before = (out / 'ckpt.pt').read_bytes(), (out / 'metrics.jsonl').read_text()
    block, model, preset, corpus = side_by_side(
        again('--eval_only=True', '--block_size=64'), again('--init_from=resume', '--attn=diff'),
        again('--eval_only=True', '--preset=small'), again('--eval_only=True', '--dataset=sy'))
    forced, changed = scripts(
        ('prepare_data.py', f'--input={tmp_path / "b.txt"}', '--name=sx', f'--data_dir={data}', '--force'),
        again('--init_from=resume', '--max_iters=8'))
    assert one_line_error(block, '--block_size=64 here but 40 in the checkpoint')
    assert one_line_error(model, "holds a different run: --attn='diff' here but 'coupled' in the checkpoint; drop")
    assert one_line_error(preset, "--n_layer=6 here but 1 in the checkpoint; --n_head=6 here but 3 in the checkpoint; "
                                  "--n_embd=384 here but 48 in the checkpoint; drop those flags (or --preset)")
    assert forced.returncode == 0, forced.stderr
    for r, name in ((corpus, 'sy'), (changed, 'sx')):  # another corpus named, or the run's corpus prepared again
        assert one_line_error(r, f"was trained on other text than {data / name} holds (corpus fingerprint {fp[:12]}, "
                                 "not "), r.stderr
    assert ((out / 'ckpt.pt').read_bytes(), (out / 'metrics.jsonl').read_text()) == before  # G1: refused, untouched
    if os.environ.get('TIKTOKEN_CACHE_DIR'):  # --sample with another tokenizer's corpus
        prepare_data.prepare(None, input=str(tmp_path / 'c.txt'), name='sz', data_dir=str(data), tokenizer='gpt2')
        r = run(*again('--sample=x', '--dataset=sz'))
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
        refused = side_by_side(*[trains(corpus, out, *args) for args in (['--seed=2'], ['--init_from=resume'])])
        ranks = run('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '--monitor-interval=1',
                    *trains(corpus, out), '--device=cpu')  # (torch 2.4's torchrun reports the ranks ended by then)
        assert first.poll() is None  # held: the refusals came while it trained
    finally:
        go.touch()  # whatever happened, the held run goes on
    for r in refused:  # (G4: an out_dir in use)
        assert one_line_error(r, 'is in use by a running train.py') and f'pid {first.pid}' in r.stderr, r.stderr
    # under torchrun every rank takes rank 0's decision: exit 2 (none waits to be killed)
    assert ranks.stderr.count('is in use by a running train.py') == 1, ranks.stderr[-3000:]
    codes = set(re.findall(r'rank\s*: (\d) .*\n\s*exitcode\s*:\s*(-?\d+)', ranks.stderr))  # torchrun's report
    assert codes == {('0', '2'), ('1', '2')}, ranks.stderr[-3000:]
    out_, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-2000:]
    log = metrics(out)
    assert [m['config']['seed'] for m in metrics(out, 'start')] == [1] and log[-1]['event'] == 'final'
    # a finished run: a scratch run in its folder is refused, and its checkpoint stays
    before = (out / 'ckpt.pt').read_bytes()
    again = train(corpus, out, '--max_iters=6', '--seed=3')
    assert one_line_error(again, 'holds a run; continue it with --init_from=resume, or train in another --out_dir')
    assert (out / 'ckpt.pt').read_bytes() == before and metrics(out) == log
    # a log but no checkpoint (deleted, or never saved): a new run keeps the earlier log
    os.remove(out / 'ckpt.pt')
    new = train(corpus, out, '--max_iters=1', '--seed=5')
    assert new.returncode == 0 and f"kept as {out / 'metrics.jsonl.1'}" in new.stdout
    assert [json.loads(line) for line in open(out / 'metrics.jsonl.1')] == log
    assert metrics(out)[0]['config']['seed'] == 5
    # two started at once on an empty folder: one trains, the other is refused and touches nothing
    both = [start(*trains(corpus, tmp_path / 'new', '--max_iters=6', f'--seed={s}')) for s in (1, 2)]
    ends = [(p.communicate(timeout=240)[1], p.returncode) for p in both]
    assert sorted(code for err, code in ends) == [0, 2]
    err = [err for err, code in ends if code == 2][0].strip()
    assert err.startswith('error:') and ('is in use by a running train.py' in err or 'holds a run' in err), err
    seeds = [m['config']['seed'] for m in metrics(tmp_path / 'new', 'start')]
    assert len(seeds) == 1 and checkpoint(tmp_path / 'new')['config']['seed'] == seeds[0]


BAD_FLAGS = [
    (['--attn=hamiltonian'], "--attn=hamiltonian is not one of 'standard', 'coupled'"),
    (['--flux=3'], "'--flux=3' is not a flag; flags look like --key=value; see --help"),
    (['--bacth_size=3'], "'--bacth_size=3' is not a flag; flags look like --key=value, e.g. --batch_size"),
    (['--batch_size=four'], "--batch_size expects an integer, got 'four'"), (['--dropout=zero'], 'expects a number'),
    (['--compile=maybe'], 'True or False'),
    (['--n_head=3'], 'not divisible'), (['--block_size=10000000'], 'lower --block_size'),
    (['--qk_dt=0.5'], "--attn=standard reads no --qk_dt; drop it, or choose a variant that reads it"),
    (['--attn=invertible', '--qk_dt=0.5', '--qk_steps=2'], "--attn=invertible reads no --qk_dt;"),
    (['--out_dir='], "--out_dir= is empty (an unset shell variable?); give it a value, e.g. --out_dir=out"),
    (['--dataset=nowhere'], 'not found; prepare the corpus first: python prepare_data.py --input=PATH --name=nowhere'),
    (['--dataset=pydocs', '--data_dir=nowhere'], 'prepare the corpus first: python prepare_data.py pydocs --data_dir='),
    (['--dataset=web', '--data_dir=no/my data'], "python prepare_data.py web --data_dir='no/my data'"),
    (['--init_from=resume'], 'no checkpoint at'), (['--eval_only=True'], 'no checkpoint at'),
    (['--device=cuda'], '--device=cuda is unknown, or not available here'), (['--device=tpu'], 'is unknown'),
    (['--init_from', 'resume'], "'--init_from' is not a flag; flags look like --key=value, e.g. --init_from=resume"),
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
    if '--device=cuda' in args and torch.cuda.is_available():
        pytest.skip('that device is available here')
    r = bad_flag_runs[0][tuple(args)]
    assert one_line_error(r, words) and r.stderr.startswith('error:'), r.stderr
    assert not glob.glob(str(bad_flag_runs[1] / '*' / 'ckpt.pt'))


NO_DRIVER = """
import os, torch
torch.version.cuda = '13.0'  # a CUDA build, whose CUDA this machine's driver does not run: torch sees no GPU
exists = os.path.exists
os.path.exists = lambda path: path == '/dev/nvidia0' or exists(path)  # an NVIDIA GPU is here
"""


def test_G4_a_cuda_build_that_sees_no_gpu_beside_an_nvidia_device_names_the_build_to_install(corpus, tmp_path):
    # a GPU whose driver is older than the wheel's CUDA: one line naming the fix, not a CPU run
    for script in (trains(corpus, tmp_path), ('bench.py', '--gpu_check')):
        r = run(*script, patch=NO_DRIVER)
        assert one_line_error(r, 'pip install torch --index-url https://download.pytorch.org/whl/cu126'), r.stderr
    assert not os.path.exists(tmp_path / 'metrics.jsonl')


def test_G3_a_corpus_prepared_again_while_a_run_trains_stops_it_with_no_final_record(corpus, tmp_path):
    data, out, go = tmp_path / 'data', tmp_path / 'out', tmp_path / 'go'
    shutil.copytree(corpus, data)
    p = start(*trains(data, out, '--max_iters=4', '--eval_interval=2'), patch=HOLD.replace('GO', repr(str(go))))
    wait_for(tmp_path / 'go.waiting')  # training
    try:
        (tmp_path / 'new.txt').write_text(TEXT)
        prepare_data.prepare(input=str(tmp_path / 'new.txt'), name='pydocs', data_dir=str(data), force=True)
    finally:
        go.touch()
    _, err = p.communicate(timeout=240)
    assert p.returncode == 2 and err.strip() == (f"error: {data}/pydocs was prepared again while this run trained, so "
                                                 "its final evaluation would score other text; train it again in "
                                                 "another --out_dir"), err
    assert 'final' not in [m['event'] for m in metrics(out)]


def test_G4_under_torchrun_a_mistake_is_one_line_from_rank_0(corpus, tmp_path):
    r = run('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', '--device=cpu',
            f'--data_dir={corpus}', '--bacth_size=3')
    assert r.returncode != 0 and r.stderr.count("error: '--bacth_size=3' is not a flag") == 1, r.stderr[-3000:]


def test_help_lists_every_flag_and_gptconfigs_defaults_where_train_py_sets_none(bad_flag_runs):
    r = bad_flag_runs[2]
    shown = dict(re.findall(r'^  --(\w+)=(.*)$', r.stdout, re.M))
    assert r.returncode == 0 and shown['attn'] == 'standard' and 'qk_scale' in shown
    laptop = {'n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size'}  # the laptop shape train.py writes down
    for f in dataclasses.fields(GPTConfig):  # qk_decay included: model, optimizer and trainer agree
        assert f.name in laptop or shown[f.name] == str(f.default), f.name
    assert not GPTConfig().qk_decay


def test_values_written_in_train_py_are_used_unless_a_flag_or_preset_says_otherwise(corpus, tmp_path):
    src = open(os.path.join(HERE, 'train.py')).read()
    for old, new in (("n_layer = 4", "n_layer = 2"), ("max_iters = 2000", "max_iters = 2"),
                     ("eval_iters = 40", "eval_iters = 2"), ("data_dir = 'data'", f"data_dir = {corpus!r}"),
                     ("out_dir = 'out'", f"out_dir = {str(tmp_path / 'a')!r}")):
        assert old in src
        src = src.replace(old, new, 1)
    (tmp_path / 'train.py').write_text(src)
    for name in ('model.py', 'prepare_data.py', 'runfolder.py'):  # beside it, as in the repository
        os.symlink(os.path.join(HERE, name), tmp_path / name)
    a, b = side_by_side(('train.py',), ('train.py', '--preset=tiny', f'--out_dir={tmp_path / "b"}'), cwd=tmp_path)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert checkpoint(tmp_path / 'a')['model_args']['n_layer'] == 2
    assert checkpoint(tmp_path / 'b')['model_args']['n_layer'] == 4


# ---------------------------------------------------------------------------------------------------------------
# G1: Ctrl-C or SIGTERM at any moment: one line, exit code 130 (143), a checkpoint being written finished first

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


@pytest.mark.parametrize('moment', ['import torch', 'setup', 'first eval', 'import torch, resuming'])
def test_G1_ctrl_c_during_start_up_stops_with_one_line(corpus, tmp_path, moment):
    if moment.startswith('import torch') and not os.path.exists('/proc/self/maps'):
        pytest.skip('needs /proc to see the import happen')
    resume = ['--init_from=resume'] if moment.endswith('resuming') else []
    if resume:  # its checkpoint must stay, and the line must not say that nothing was saved
        assert train(corpus, tmp_path, '--max_iters=2', '--eval_interval=2').returncode == 0
        before = (tmp_path / 'ckpt.pt').read_bytes()
    p = subprocess.Popen([sys.executable, 'train.py', f'--data_dir={corpus}', f'--out_dir={tmp_path}', *SMALL,
                          *resume], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1'))
    if moment.startswith('import torch'):  # torch's library is being loaded: the handler is in, torch is not yet
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
    if resume:
        assert 'its checkpoint is as it was' in last and (tmp_path / 'ckpt.pt').read_bytes() == before, last


@pytest.mark.parametrize('sig', ['SIGINT', 'SIGTERM'])
def test_G1_ctrl_c_or_sigterm_stops_a_run_with_one_line_that_resumes_it(corpus, tmp_path, sig):
    # Ctrl-C, even to a background job of `sh -c 'python train.py & wait'` (SIGINT ignored), or kill: exit 130 or
    # 143, and one line whose command, pasted into a shell, resumes (a space: quoted)
    out = tmp_path / 'a run'
    p = start(*trains(corpus, out, '--max_iters=100000', '--eval_interval=5'), sigint_ignored=sig == 'SIGINT')
    wait_for(out / 'ckpt.pt')
    p.send_signal(getattr(signal, sig))
    last, _ = stopped_cleanly(p, code=130 if sig == 'SIGINT' else 143)
    assert last.startswith('interrupted at iteration' if sig == 'SIGINT' else 'terminated at iteration'), last
    command = last.split('Continue with: ')[1]
    assert shlex.split(command)[-1] == f'--out_dir={out}'
    at = checkpoint(out)['iter_num']  # (a loaded machine gets further than 5)
    r = run(*shlex.split(command)[1:], f'--max_iters={at + 1}')
    assert r.returncode == 0, r.stderr


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
    # once: the checkpoint is finished, then the run stops; twice: at once, the previous one intact; the second at
    # the rename: the line names the checkpoint on disk
    flag = tmp_path / 'saving'
    patch = SLOW_SAVE.replace('FLAG', repr(str(flag))).replace('RENAME', str('rename' in presses))
    p = start(*trains(corpus, tmp_path / 'out', '--max_iters=100000', '--eval_interval=5'), patch=patch)
    wait_for(flag)
    t0 = time.time()
    for _ in range(1 if presses == '1' or 'rename' in presses else 2):
        p.send_signal(signal.SIGINT)
        time.sleep(0.3)
    last, _ = stopped_cleanly(p)
    ckpt = checkpoint(tmp_path / 'out')
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
    p = start(*trains(corpus, out, *extra), patch=patch)
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


# ---------------------------------------------------------------------------------------------------------------
# train.py: best-only checkpoints, a run that diverges, DDP on two CPU ranks, compile

def test_a_best_only_checkpoint_says_what_it_holds_and_the_final_evaluation_scores_it(corpus, tmp_path):
    out = tmp_path / 'out'
    assert train(corpus, out, '--max_iters=2', '--eval_interval=2').returncode == 0
    ckpt = checkpoint(out)
    torch.save(ckpt | dict(best_val_loss=1e-3), out / 'ckpt.pt')  # a best estimate that no later one beats
    extended, evaluated = scripts(
        trains(corpus, out, '--init_from=resume', '--max_iters=4', '--eval_interval=1',
               '--always_save_checkpoint=False'), trains(corpus, out, '--eval_only=True'))
    assert extended.returncode == 0, extended.stderr
    assert f"checkpoint {out / 'ckpt.pt'} at iteration 2 (val loss {ckpt['val_loss']:.4f}, the best" in extended.stdout
    final = metrics(out)[-1]
    assert checkpoint(out)['iter_num'] == 2
    assert (final['iter'], final['model_iter'], final['model_tokens']) == (4, 2, ckpt['tokens'])
    assert f"ppl {final['val_ppl']:.3f}" in evaluated.stdout  # --eval_only scores the model the final record scored
    assert "ckpt.pt holds the model of iteration 2\n" in evaluated.stdout  # and says which


def test_a_run_that_diverges_without_a_nan_ends_without_a_traceback(corpus, tmp_path):
    # a finite but huge loss: an infinite perplexity, not an OverflowError (NaNs: below)
    r = train(corpus, tmp_path, '--max_iters=30', '--learning_rate=5', '--warmup_iters=0', '--grad_clip=0',
              '--eval_interval=10')
    assert r.returncode in (0, 3) and 'Traceback' not in r.stderr, r.stderr[-2000:]


def test_time_budget_stops_the_run_and_counts_across_a_resume(corpus, tmp_path):
    r, again = scripts(trains(corpus, tmp_path, '--max_iters=100000', '--time_budget=2', '--eval_interval=100000'),
                       trains(corpus, tmp_path, '--init_from=resume'))  # the budget is spent: no more training
    assert r.returncode == 0 and again.returncode == 0, r.stderr + again.stderr
    last = metrics(tmp_path, 'final')[0]
    assert 2 <= last['time'] < 10 and last['iter'] < 100000
    assert metrics(tmp_path, 'train')[-1]['iter'] == last['iter']
    assert metrics(tmp_path, 'final')[-1]['time'] == pytest.approx(last['time'])


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

# rank 1: its compile fails, and its val estimates never improve while rank 0's do: a rank-local decision to save
# (--always_save_checkpoint=False) would hang. notes: [estimate_loss's all-reduces, the sequences it scored]
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

# Dynamo and AOT autograd without inductor's C++ compile; DDP buckets of 1 MB, to split this model
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
    """Two gloo ranks, 6 iterations of coupled: rank 1 fails to compile and disagrees about the val loss; the same
    run compiled inside DDP (aot_eager)."""
    d = tmp_path_factory.mktemp('ddp')
    flags = [f'--data_dir={corpus}', '--max_iters=6', '--eval_interval=3', '--attn=coupled', '--compile=True']
    return d, scripts(torchrun(d / 'eager', RANK1_DIFFERS, *flags, '--always_save_checkpoint=False'),
                      torchrun(d / 'compiled', COMPILE_IN_DDP, *flags))


def test_ddp_two_cpu_ranks_see_different_batches_and_end_identical(ddp_runs):
    # rank 0 decides whether to save; a compile failure on rank 1 makes both ranks run eager
    d, (r, compiled) = ddp_runs
    tmp_path = d / 'eager'
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count('warning: torch.compile failed') == 1 and 'eager, 2' in r.stdout
    assert [m['compiled'] for m in metrics(tmp_path, 'start')] == [False]
    assert checkpoint(tmp_path)['iter_num'] == 6  # rank 0's val loss improved
    ranks = [json.load(open(tmp_path / f'rank{i}.json')) for i in range(2)]
    assert ranks[0]['weights'] == ranks[1]['weights'] and ranks[0]['batch'] != ranks[1]['batch']
    # 3 evals of 2 splits: one all-reduce each; each rank 4 of the 2 x 4 sequences (--eval_iters=2, batch 4)
    assert ranks[0]['notes'] == ranks[1]['notes'] == [3 * 2, 3 * 2 * 4]
    assert '2 process(es)' in r.stdout
    single, resumed = scripts(('train.py', f'--out_dir={tmp_path}', '--eval_only=True'),
                              ('train.py', f'--out_dir={tmp_path}', '--init_from=resume', '--max_iters=8',
                               '--compile=False'))
    full = lambda out: float(re.search(r'full val split: loss ([\d.]+)', out).group(1))
    assert full(r.stdout) == pytest.approx(full(single.stdout), abs=2e-4)  # two ranks score one process's windows
    # resumed as one process: tokens trained, 6 x 2 ranks, then 2 x 1
    assert resumed.returncode == 0, resumed.stderr
    assert 'note: the checkpoint was trained by 2 process(es), this run has 1: its batches are drawn anew' \
        in resumed.stdout  # said, not silent
    assert metrics(tmp_path, 'final')[-1]['tokens'] == (6 * 2 + 2) * 4 * 32


def test_ddp_compiles_inside_ddp_split_at_its_buckets_and_trains_as_eager(ddp_runs):
    # compiled inside DDP's forward: Dynamo splits the one graph at DDP's gradient buckets (their all-reduce overlaps
    # the backward)
    d, (eager, r) = ddp_runs
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'torch.compile failed' not in r.stdout and 'compiled, 2 process(es)' in r.stdout
    assert [m['compiled'] for m in metrics(d / 'compiled', 'start')] == [True]
    ranks = [json.load(open(d / 'compiled' / f'rank{i}.json')) for i in range(2)]
    assert [(r['graphs'], r['notes']) for r in ranks] == [(1, [2])] * 2  # one graph, split into two buckets
    assert not any(k.startswith(('_orig_mod.', 'module.')) for k in checkpoint(d / 'compiled')['model'])  # loads eager
    assert ranks[0]['weights'] == ranks[1]['weights']
    want = json.load(open(d / 'eager' / 'rank0.json'))['weights']
    assert ranks[0]['weights'] == pytest.approx(want, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the loop on a GPU's terms: estimates shared by ranks, no sync between log steps, NaNs, MFU

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
    """train.py's functions `names`, over the globals `run` (what train.py's set-up would have made)."""
    tree = ast.parse(open(os.path.join(HERE, 'train.py')).read())
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert [d.name for d in defs] == list(names)
    exec(compile(ast.Module(defs, type_ignores=[]), 'train.py', 'exec'), run)
    return run


def test_ddp_estimates_split_one_process_s_sequences_and_their_shares_sum_to_its_estimate(corpus):
    # W ranks split one process's eval_iters x batch_size sequences (16 ranks > 15: some get none) and all-reduce
    # their (eval_iters,) batch means, once a split: one process's estimate, to rounding
    splits = {s: os.path.join(corpus, 'pydocs', f'{s}.bin') for s in ('train', 'val')}
    net = GPT(tiny('coupled', vocab_size=257, block_size=16)).eval()
    E, B, T = 5, 3, 16

    class Dist:  # each rank's tensor as it goes into the all-reduce
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
    one = estimate(0, 1)  # one process: the mean loss of eval_iters batches, the same at every eval (seed 10,000)
    data, gen = np.memmap(splits['val'], dtype=np.uint16, mode='r'), torch.Generator().manual_seed(10_000)
    seqs = lambda ix, o: torch.stack([torch.from_numpy(data[i + o:i + o + T].astype(np.int64)) for i in ix])  # noqa
    want = [net(seqs(ix, 0), seqs(ix, 1))[1].item() for ix in (torch.randint(len(data) - T - 1, (B,), generator=gen)
                                                                  for _ in range(E))]
    assert not shares and one['val'] == pytest.approx(np.mean(want), rel=1e-6)
    for W in (2, 4, 16):
        shares = []
        for rank in range(W):
            estimate(rank, W)
        assert len(shares) == 2 * W  # one all-reduce per split and rank
        for i, split in enumerate(('train', 'val')):
            mine = torch.stack(shares[i::2])  # (W, E): each rank's shares of the batch means
            assert mine.sum(0).mean().item() == pytest.approx(one[split], rel=1e-6, abs=0), (W, split)
        if W == 16:  # 15 sequences: rank 0's share is empty (it draws the batches and reduces zeros)
            assert not shares[0].any() and shares[-1].count_nonzero().item() == 1


def test_the_loop_syncs_with_the_device_only_at_log_steps_and_evals(corpus, tmp_path):
    # every .item(), .cpu(), bool(tensor)... of train.py's, by iteration: none between log steps (every 10) and
    # evals (every 15), so a GPU never waits for the host
    patch = COUNT_SYNCS.replace('SYNCS', repr(str(tmp_path / 'syncs.json')))
    r = run(*trains(corpus, tmp_path / 'out', '--max_iters=30', '--log_interval=10', '--eval_interval=15'), patch=patch)
    assert r.returncode == 0, r.stderr[-2000:]
    calls = json.load(open(tmp_path / 'syncs.json'))
    in_loop = {it for it, fn, name in calls if fn in ('<module>', 'check_losses')}
    assert in_loop and in_loop <= {0, 1, 10, 15, 20, 30}, sorted(in_loop)  # evals 0, 15, 30; logs 1, 10, 20, 30
    assert {10, 20} <= in_loop  # the log steps read the loss (a sync every iteration would be seen)


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
model.peak_flops = lambda device, dtype: 1e12  # MFU as on a GPU whose peak is known
"""


@pytest.fixture(scope='module')
def nan_runs(corpus, tmp_path_factory):
    """NaNs at iteration 12 (logs every 5) and 18 (every 7: an interval ending at an eval) of runs that save every
    10, each then resumed; a finished run resumed to train longer, a NaN at iteration 6."""
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
    # the step taken at iter_num 12 is the log's "iter 13": the NaN is named as the log names it
    assert r.returncode == 3 and f'not finite at iteration {at + 1} ' in r.stderr, r.stderr[-2000:]
    assert 'the last checkpoint is at iteration 10:' in r.stderr and one_line_error(r, '--init_from=resume')
    assert resumed.returncode == 0 and 'at iteration 10' in resumed.stdout, resumed.stderr
    ckpt = checkpoint(d / run)
    assert ckpt['iter_num'] == 40 and all(torch.isfinite(v).all() for v in ckpt['model'].values())
    assert math.isfinite(metrics(d / run, 'final')[-1]['val_loss'])
    assert [m['iter'] for m in metrics(d / run, 'diverged')] == [at + 1]  # logged, for results/report.py


def test_a_finished_run_resumed_to_train_longer_keeps_its_result_when_the_extension_stops(nan_runs, capsys):
    d, rs = nan_runs
    first, extension = rs[4:]
    assert first.returncode == 0 and extension.returncode == 3, extension.stderr
    assert one_line_error(extension, 'the last checkpoint is at iteration 6:')  # saved at 6 (eval), NaN at 6
    finals = metrics(d / 'finished', 'final')
    assert len(finals) == 1 and finals[0]['iter'] == 4  # the log is appended to, never rewritten
    # the report reads train.py's own log: that result, and the attention at its final eval
    code, out, err = tabulate(capsys, d / 'finished')
    assert code == 0 and f"| {finals[0]['val_ppl']:.3f} |" in out and '\nAttention at the final eval' in out, (out, err)
    assert metrics(d / 'finished')[0]['vocab_size'] == 257  # the start record's: a failed run is judged by it


def test_mfu_divides_by_the_dense_bf16_peak_or_half_of_it_in_float32_where_the_peak_is_known(nan_runs, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'NVIDIA H100 80GB HBM3')
    assert M.peak_flops('cuda:0', 'bfloat16') == M.peak_flops('cuda:0', 'float16') == 989e12
    assert M.peak_flops('cuda:0', 'float32') == 989e12 / 2 and M.peak_flops('cpu', 'float32') is None
    d, rs = nan_runs  # (their peak: a mocked 1e12)
    assert re.search(r'iter 4/4 \| .* \| mfu \d+\.\d%', rs[4].stdout), rs[4].stdout
    record = metrics(d / 'finished', 'train')[-1]
    want = flops_per_token(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=32, vocab_size=257), 32) * 4 * 32
    assert record['mfu'] == pytest.approx(want / (record['ms'] / 1000) / 1e12, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# a GPU's facts checked on a CPU: dtype=auto, diff's SDPA calls, compiled graphs, bf16

@pytest.mark.parametrize('native, emulated, want', [(True, True, 'bfloat16'), (False, True, 'float16'),
                                                    (False, False, 'float16')])
def test_dtype_auto_is_bf16_only_where_the_gpu_computes_it_natively(monkeypatch, native, emulated, want):
    # A100/H100: native bf16; T4/V100: emulated only, so fp16 (with train.py's GradScaler)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported',
                        lambda including_emulation=True: native or (emulated and including_emulation))
    assert M.autocast_dtype('cuda:0') == want and M.autocast_dtype('cpu') == 'float32'


@pytest.mark.parametrize('attn', ['diff', 'diff+coupled'])
def test_diff_attention_with_v_split_to_the_head_size_is_the_same_attention(attn, monkeypatch):
    # split_v: every SDPA call sees q, k, v of one head size (as flash attention needs); outputs, gradients and the
    # KV cache's logits as with v at its full width
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


def test_diff_coupled_under_bf16_autocast_warns_nothing_and_learns_in_float32():
    # diff's per-head RMSNorm runs in float32 (as autocast runs LayerNorm): no mismatch with its gain, no warning;
    # leapfrog's loss near chance at init, the q/k maps' gradients float32 and finite
    model, idx = build('diff+coupled'), idx_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with torch.autocast('cpu', dtype=torch.bfloat16):
            loss = model(idx, targets=idx)[1]
        loss.backward()
    assert not [str(w.message) for w in caught] and abs(loss.item() - math.log(50)) < 1.0
    grads = [p.grad for qk in qk_maps(model) for p in qk.parameters()]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_a_compiled_training_step_has_no_graph_break_and_no_recompile():
    # every --attn as train.py compiles it (bf16 autocast), three steps: one graph, made at the first (the eager
    # backend: traced as on a GPU, without inductor)
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


# ---------------------------------------------------------------------------------------------------------------
# bench.py: records, not timings (timings are never asserted)

def bench_main(capsys, monkeypatch, *args):
    """python bench.py ARGS in this process (a process of its own would pay torch's import): a CompletedProcess,
    with the records main() returned."""
    monkeypatch.setattr(sys, 'argv', ['bench.py', *args])
    code, out, err, records = main_of(capsys, bench.main)
    r = subprocess.CompletedProcess('bench.py', code, out, err)
    r.records = records
    return r


def failing_backend(gm, inputs):
    raise RuntimeError('no compiler here (a test)')


@pytest.mark.parametrize('backend', ['eager', failing_backend])
def test_gpu_check_runs_at_a_reduced_shape_on_cpu(capsys, monkeypatch, backend):
    # as on a GPU (CUDA patched in), tiny, on the CPU; a compile that fails: the check goes on eager, and says so
    available = torch.cuda.is_available  # True for bench.py's own question only (Dynamo asks it too)
    asked_by_bench = lambda: sys._getframe(2).f_code is bench.main.__code__
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: asked_by_bench() or available())
    real = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda model: real(model, backend=backend))
    r = bench_main(
        capsys, monkeypatch, '--gpu_check', '--device=cpu', '--dtype=bfloat16', '--preset=tiny', '--batch_size=2',
        '--block_size=16', '--vocab_size=64', '--iters=1', '--warmup=0')
    assert r.returncode == 0, r.stderr[-2000:]
    works = backend == 'eager'
    failed = [f'torch.compile failed for {v}' in r.stdout for v in ('standard', 'coupled')]
    assert failed == [not works] * 2
    # coupled's map at 60m's head shape on bf16 q, k against float64: bf16 keeps 8 bits (0.4% a rounding): q', k'
    # within 1%; the move q' - q (~10% of q, rounded again when added) within 5%
    out, move = map(float, re.search(r'q/k map \(coupled\) in bf16 against float64: output ([\d.]+)%, its move '
                                     r'([\d.]+)%', r.stdout).groups())
    assert 0 < out < 1 and 0 < move < 5, (out, move)
    assert 'sync debug mode: skipped (CUDA only)' in r.stdout  # a CPU: no CUDA sync check
    assert re.search(r'coupled / standard, eager: \d+\.\d{3}\n', r.stdout), r.stdout[-1500:]
    assert re.search(r'coupled / standard, compiled: \d+\.\d{3}\n', r.stdout) or not works
    assert ('compile did not run' in r.stdout) != works and 'diff, eager: v at 2hs' in r.stdout
    records = r.records
    assert sorted(rec['attn'] for rec in records) == ['coupled', 'coupled', 'diff (split_v=False)',
                                                      'diff (split_v=True)', 'standard', 'standard']
    assert sorted(rec['compiled'] for rec in records) == [False] * (6 - 2 * works) + [True] * (2 * works)
    assert all(rec['mfu'] is None for rec in records)  # no peak known for a CPU
    assert M.CausalSelfAttention.split_v is None  # restored


def test_G4_gpu_check_without_cuda_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    r = bench_main(capsys, monkeypatch, '--gpu_check')
    assert one_line_error(r, '--gpu_check needs a CUDA GPU') and r.stdout == ''


def test_bench_returns_one_record_per_variant_and_mode(capsys, monkeypatch):
    r = bench_main(
        capsys, monkeypatch, '--preset=tiny', '--attn=coupled,diff+coupled', '--vocab_size=64', '--batch_size=2',
        '--block_size=16', '--new_tokens=4', '--iters=1', '--warmup=0')
    assert r.returncode == 0, r.stderr[-2000:]
    records = list(r.records.values())
    modes = ('train', 'forward', 'generate', 'generate-nocache')
    assert {(rec['attn'], rec['mode']) for rec in records} == {(a, m) for a in ('standard', 'coupled', 'diff+coupled')
                                                                for m in modes}
    for rec in records:
        assert rec['ms_per_iter'] > 0 and rec['tokens_per_s'] > 0
        assert (rec['ratio_vs_standard'] == 1.0) == (rec['attn'] == 'standard')
    flop = {rec['attn']: rec['flop_model_ratio'] for rec in records if rec['mode'] == 'train'}
    assert flop['standard'] == 1.0 and 1.0 < flop['coupled'] < flop['diff+coupled'] < 1.05


@pytest.mark.parametrize('args, words', [
    (['--attn=hamiltonian'], 'hamiltonian'), (['--mode=backward'], 'backward'), (['--preset=huge'], 'preset'),
    (['--device=tpu'], '--device=tpu is unknown, or not available here'), (['--plan', '--world_size=3'],
                                                                            '--world_size=3'),
    (['--attn=standard,diff', '--qk_hidden=3'], '--attn=standard,diff reads no --qk_hidden; drop it'),
    (['--json_out=bench.jsonl'], '--json_out has moved: results/speed.py writes runs/speed.jsonl'),
])
def test_G4_bench_bad_flags_give_one_clear_line(args, words, capsys, monkeypatch):
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
    # 8 GPUs: the README's launcher and per-rank flags are --plan --world_size=8's; 65,536 tokens a step either way
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


def test_plan_splits_training_over_the_ranks_adds_the_compile_and_says_it_is_an_estimate(capsys, monkeypatch):
    cfg, T, compile = GPTConfig(**PRESETS['60m']), 512, bench.COMPILE_MINUTES
    one, eight = (bench.plan_minutes(cfg, T, 1.31e9, ws, 989e12) - compile for ws in (1, 8))
    assert eight == pytest.approx(one / 8) and one == pytest.approx(
        1.31e9 * flops_per_token(cfg, T) / (bench.UTILISATION * 989e12) / 60)
    r = bench_main(capsys, monkeypatch, '--plan', '--world_size=8')
    row = re.search(r'^\| standard \| .*\| ([\d.]+) (min|h) \| [\d.]+ (?:min|h) \|$', r.stdout, re.M)
    assert r.returncode == 0 and float(row.group(1)) == round(bench.plan_minutes(
        cfg, T, 1_310_720_000, 8, bench.GPU_PEAK_FLOPS['NVIDIA H100 80GB HBM3'])), r.stdout
    assert 'Each time is an estimate' in r.stdout and 'compilation' in r.stdout


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


def test_sample_prints_text_from_a_bytes_and_a_gpt2_checkpoint(resumed, wikitext103, tmp_path):
    # bytes (the quick start's kind of run); GPT-2 tokens at the end of a run and from its checkpoint
    b, g = resumed[0] / 'a', tmp_path / 'gpt2'
    sample = lambda out, *a: ('train.py', f'--out_dir={out}', *a)  # noqa: E731
    r, again, other, gtrained = side_by_side(
        sample(b, '--sample=def ', '--sample_tokens=40'), sample(b, '--sample=def ', '--sample_tokens=40'),
        sample(b, '--sample=def ', '--sample_tokens=40', '--seed=7'),
        ('train.py', *REDUCED, f'--data_dir={wikitext103}', '--dataset=wikitext103', f'--out_dir={g}',
         '--sample_tokens=12'))
    gr = run(*sample(g, '--sample=The query', '--sample_tokens=12'))
    assert r.returncode == 0, r.stderr
    head, text = r.stdout.split("sample (seed 1337, 40 tokens after 'def '):\n")
    assert text.startswith('def ') and len(text.encode('utf-8', 'surrogateescape')) >= 40
    assert again.stdout == r.stdout and other.stdout != r.stdout  # the seed decides
    assert 'resuming' not in r.stdout and not (b / 'ckpt.pt.tmp').exists()
    assert gtrained.returncode == 0 and "sample (seed 1337, 12 tokens after ''):" in gtrained.stdout, gtrained.stderr
    assert gr.returncode == 0, gr.stderr
    text = gr.stdout.split("tokens after 'The query'):\n")[1]
    import tiktoken
    assert text.startswith('The query') and len(tiktoken.get_encoding('gpt2').encode(text)) >= 12


def test_G4_offline_a_sample_is_one_line_and_a_finished_run_keeps_its_results(corpus, tmp_path):
    # no tokenizer (tiktoken offline, no cache): the run's end says so in a line and exits 0; --sample stops with it
    offline = ("import prepare_data\ndef offline(name):\n    raise prepare_data.DataError('tiktoken could not load the "
               "GPT-2 BPE files (ConnectionError); offline, export TIKTOKEN_CACHE_DIR=...')\n"
               "prepare_data.get_tokenizer = offline\n")
    trained = run(*trains(corpus, tmp_path, '--max_iters=2', '--eval_interval=2', '--sample_tokens=20'), patch=offline)
    assert trained.returncode == 0 and metrics(tmp_path)[-1]['event'] == 'final', trained.stderr[-2000:]
    assert trained.stdout.count('note: no sample: tiktoken could not load') == 1 and 'done: 2 iterations' in \
        trained.stdout and trained.stderr == '', trained.stdout[-2000:]
    sampled = run('train.py', f'--out_dir={tmp_path}', '--sample=def ', patch=offline)
    assert one_line_error(sampled, 'error: tiktoken could not load the GPT-2 BPE files'), sampled.stderr


REDUCED = ['--n_layer=1', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=1',
           '--gradient_accumulation_steps=2', '--max_iters=2', '--eval_interval=2', '--eval_iters=1',
           '--warmup_iters=1', '--compile=False', '--device=cpu', '--sample_tokens=0']  # compile: its own test


def test_every_gpu_recipe_command_runs_at_a_reduced_shape_and_tabulates(wikitext103, tmp_path, capsys):
    prefix, rows = gpu_recipe()
    command = lambda flags: shlex.split(prefix)[2:] + shlex.split(flags) + REDUCED + [
        f'--data_dir={wikitext103}', '--dtype=bfloat16']  # what --dtype=auto picks on an A100 or H100
    with ThreadPoolExecutor(2) as pool:  # two processes side by side, half the runs in each
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
# the repository: what train.py imports, what the README and results/ point to

def readme_section(title):
    return open(os.path.join(HERE, 'README.md'), encoding='utf-8').read().split(f'\n## {title}\n')[1].split('\n## ')[0]


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
    names = ['README.md', 'model.py', 'train.py', 'prepare_data.py', 'bench.py', 'test_model.py', 'test_scripts.py',
             'conftest.py']
    for folder in ('exercises', 'results'):
        names += [os.path.join(folder, f) for f in os.listdir(os.path.join(HERE, folder)) if '.' in f[1:]
                  and f.rsplit('.', 1)[1] in ('py', 'md', 'sh')]
    for name in names:
        text = open(os.path.join(HERE, name), encoding='utf-8').read()
        assert '..' + '/shared' not in text and '/work' + '/shared' not in text, name
