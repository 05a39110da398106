"""
Turn a corpus into token files for train.py: data/<name>/{train,val[,test]}.bin (uint16) and meta.json.

  python prepare_data.py                          # pydocs: offline, Python's own docs, byte tokens
  python prepare_data.py shakespeare              # Tiny Shakespeare (download, 1 MB)
  python prepare_data.py pubmed                   # 1,000 PubMed abstracts (download, 2.6 MB): the paper's domain text
  python prepare_data.py web                      # 1,000 C4 web pages (download, 0.9 MB): the paper's web text
  python prepare_data.py wikitext103              # the paper's corpus (download, 190 MB zip), GPT-2 tokens
  python prepare_data.py --input=PATH --name=NAME # any local .txt/.jsonl/.jsonl.gz file, or a folder of them

Each document ends with an end-of-text token: <|endoftext|> (50256) for gpt2, 256 for bytes. Outputs appear
atomically (temp file, then rename), meta.json last; finished work is redone only with --force.
"""
import os
import signal


def on_ctrl_c(signum, frame):  # Ctrl-C during the imports: one line, exit code 130
    os.write(2, b"\ninterrupted: nothing was written\n")
    os._exit(130)


if __name__ == '__main__':  # before the slow imports
    signal.signal(signal.SIGINT, on_ctrl_c)

import argparse  # noqa: E402
import ast  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
import zipfile  # noqa: E402

import numpy as np  # noqa: E402

# name -> its default tokenizer and source
CORPORA = {
    'pydocs': dict(tokenizer='bytes',
                   about="CPython's bundled reference docs (pydoc_data) + stdlib docstrings; offline"),
    'shakespeare': dict(tokenizer='bytes',
                        url='https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt',
                        sha256='86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed'),
    'pubmed': dict(tokenizer='bytes',
                   url='https://raw.githubusercontent.com/pubmedqa/pubmedqa/1cbae8e92f72f20c8d3747cbb3bf5bc53554d997/'
                       'data/ori_pqal.json',
                   sha256='8b3276be8942ebbd77f3ddcda12c1749bf0e490045a736fd8438ee40cf37a41d'),
    'web': dict(tokenizer='bytes',
                url='https://raw.githubusercontent.com/allenai/OLMo/06c867c36986328ac31e3877faca286dba0925c3/'
                    'test_fixtures/c4-sample.00000-of-00001.json.gz',
                sha256='75cdeb8bacc1fd115eaf338290fc7c6ac60e48c9f88d12250511666a201eee1c'),
    'wikitext2': dict(tokenizer='gpt2',
                      url='https://wikitext.smerity.com/wikitext-2-raw-v1.zip', prefix='wikitext-2-raw/'),
    'wikitext103': dict(tokenizer='gpt2',
                        url='https://wikitext.smerity.com/wikitext-103-raw-v1.zip', prefix='wikitext-103-raw/'),
}


class DataError(Exception):
    """Bad input or a failed download: reported as one line."""


def remove(path):
    if os.path.exists(path):
        os.remove(path)


# -----------------------------------------------------------------------------
# tokenizers: text -> uint16 token arrays

TOKENIZERS = dict(bytes=(257, 256, 1), gpt2=(50257, 50256, 128))  # vocab_size, end of text, most bytes a token holds


def get_tokenizer(name):
    """encode: [text] -> [uint16 array]; decode: token ids -> text (end-of-text shown as <|endoftext|>)."""
    if name == 'bytes':  # 256 byte values + end-of-text 256
        return dict(name='bytes', vocab_size=257, eot=256,
                    encode=lambda texts: [np.frombuffer(t.encode('utf-8', 'surrogateescape'), dtype=np.uint8)
                                          .astype(np.uint16) for t in texts],
                    decode=lambda ids: b''.join(b'\n<|endoftext|>\n' if t == 256 else bytes([t]) for t in ids)
                    .decode('utf-8', 'replace'))
    import tiktoken
    try:
        enc = tiktoken.get_encoding('gpt2')
    except Exception as e:  # tiktoken downloads its BPE files on first use
        raise DataError(f"tiktoken could not load the GPT-2 BPE files ({type(e).__name__}); offline, export "
                        "TIKTOKEN_CACHE_DIR=<a folder of the cached files> (prepare_data.py: or --tokenizer=bytes)")
    return dict(name='gpt2', vocab_size=enc.n_vocab, eot=enc.eot_token, decode=enc.decode,
                encode=lambda texts: [np.array(t, dtype=np.uint16) for t in enc.encode_ordinary_batch(texts)])


def chunks(text, size=1 << 20):
    """Split a document at line ends into ~1 MB pieces: tokenization streams, in threads."""
    start = 0
    while start < len(text):
        end = text.find('\n', start + size)
        end = len(text) if end == -1 else end + 1
        yield text[start:end]
        start = end


def write_tokens(tmp, docs, tok):
    """Tokenize docs into the file tmp; return (tokens, UTF-8 bytes of the text, for bits per byte)."""
    n, n_bytes = 0, 0
    with open(tmp, 'wb') as f:
        for doc in docs:
            pieces = list(chunks(doc))
            for i in range(0, len(pieces), 16):
                for arr in tok['encode'](pieces[i:i + 16]):
                    f.write(arr.tobytes())
                    n += len(arr)
            n_bytes += len(doc.encode('utf-8'))
            f.write(np.array([tok['eot']], dtype=np.uint16).tobytes())
            n += 1
    return n, n_bytes


# -----------------------------------------------------------------------------
# sources: each returns {split: [documents]}

def download(url, dest, sha256=None, attempts=3):
    """Fetch url to dest atomically, with progress, retries and a size/checksum check."""
    if os.path.exists(dest):
        return dest
    tmp = f"{dest}.tmp{os.getpid()}"
    req = urllib.request.Request(url, headers={'User-Agent': 'coupled-qk-prepare-data/1.0 (python urllib)'})
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(req, timeout=30) as r, open(tmp, 'wb') as f:
                total, got, t0 = int(r.headers.get('Content-Length') or 0), 0, time.time()
                while block := r.read(1 << 20):
                    f.write(block)
                    got += len(block)
                    rate = got / max(time.time() - t0, 1e-9) / 1e6
                    print(f"\rdownloading {url}: {got / 1e6:.1f}" + (f"/{total / 1e6:.1f}" if total else '')
                          + f" MB, {rate:.1f} MB/s", end='', flush=True)
            print()
            if total and got != total:
                raise DataError(f"download of {url} stopped at {got} of {total} bytes")
            if sha256 and sha256_of(tmp) != sha256:
                raise DataError(f"{url} does not have the expected sha256; the file changed upstream")
            os.replace(tmp, dest)
            return dest
        except (OSError, DataError) as e:
            reason = getattr(e, 'reason', e)
            if attempt == attempts:
                raise DataError(f"cannot download {url} ({reason}); offline, give a copy of it with "
                                f"--input=<path to {os.path.basename(url)}>, or use pydocs (built in)")
            print(f"\ndownload failed ({reason}); retry {attempt}/{attempts - 1} in {2 ** attempt} s")
            time.sleep(2 ** attempt)
        finally:
            remove(tmp)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def fingerprint(splits):
    """The corpus's identity: sha256 over each split's name and the sha256 of its token file."""
    return hashlib.sha256(''.join(f"{s}:{sha256_of(splits[s])}\n" for s in sorted(splits)).encode()).hexdigest()


def input_sha256(path):
    """A local --input's identity: sha256 over its files' paths (relative to it) and contents."""
    h = hashlib.sha256()
    for fn in input_files(path, quiet=True):
        if os.path.isfile(fn):
            h.update(f"{os.path.relpath(fn, path)}:{sha256_of(fn)}\n".encode())
    return h.hexdigest()


def pydocs():
    """Python's reference documentation (pydoc_data.topics) and the docstrings of its standard library."""
    docs = []
    try:
        from pydoc_data.topics import topics
        docs += [topics[k] for k in sorted(topics)]
    except ImportError:
        print("note: this Python has no pydoc_data; using docstrings only")
    root = sysconfig.get_paths()['stdlib']
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ('site-packages', 'dist-packages', 'test', 'tests',
                                                                 'idle_test', '__pycache__'))
        for fn in sorted(f for f in filenames if f.endswith('.py')):
            try:  # parse, never import: no side effects
                tree = ast.parse(open(os.path.join(dirpath, fn), encoding='utf-8').read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            parts = [ast.get_docstring(n) for n in ast.walk(tree)
                     if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            text = '\n\n'.join(p for p in parts if p)
            if text:
                docs.append(text)  # one document per module
    n = sum(map(len, docs))
    if n < 100_000:
        raise DataError(f"found only {n} characters of docs in {root}; use --input=PATH")
    return {'all': docs}


JSONL = ('.jsonl', '.jsonl.gz', '.json.gz')  # JSON lines, gzipped or not


def input_files(path, quiet=False):
    """--input's files: itself, or the .txt/.jsonl[.gz] files in its folder tree, links followed, each folder once;
    a pipe, device or socket is skipped with a note (reading it could wait forever)."""
    if not os.path.isdir(path):
        return [path]
    files, seen = [], set()
    for d, dirs, fs in os.walk(path, followlinks=True):
        if os.path.realpath(d) in seen:  # a link loop, or a folder linked twice
            dirs.clear()
            continue
        seen.add(os.path.realpath(d))
        dirs.sort()
        for f in sorted(f for f in fs if f.endswith(('.txt',) + JSONL)):
            if os.path.isfile(os.path.join(d, f)):
                files.append(os.path.join(d, f))
            elif not quiet:
                why = 'not a regular file (a pipe, device or socket)' if os.path.exists(os.path.join(d, f)) else \
                    'a link to nothing'
                print(f"note: skipped {os.path.join(d, f)}: {why}")
    return files


def read_local(path, jsonl=None):
    """A .txt file (one document), a .jsonl[.gz] file (a document per line, field 'text'), or a folder of them;
    jsonl=True/False: JSON lines / plain text whatever the name."""
    if not os.path.exists(path):
        raise DataError(f"--input={path} does not exist; give a .txt/.jsonl/.jsonl.gz file or a folder of them")
    files = input_files(path)
    if not files:
        raise DataError(f"--input={path} holds no .txt, .jsonl or .jsonl.gz files")
    docs = []
    for fn in files:
        with open(fn, 'rb') as f:
            gzipped = f.read(2) == b'\x1f\x8b'
        if jsonl is False and gzipped:
            raise DataError(f"{fn} is gzip-compressed, not plain text")
        try:
            with (gzip.open(fn, 'rt', encoding='utf-8-sig') if gzipped else open(fn, encoding='utf-8-sig')) as f:
                if not (fn.endswith(JSONL) if jsonl is None else jsonl):
                    docs.append(f.read())
                    if jsonl is False and docs[-1].lstrip().startswith('{'):
                        raise DataError(f"{fn} is JSON, not plain text")
                    continue
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)['text']
                        text.encode('utf-8')  # a lone surrogate ("\ud800") is valid JSON but not text
                    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                        raise DataError(f"{fn}:{i} is not a JSON object with a string field 'text'")
                    except UnicodeEncodeError:
                        raise DataError(f"{fn}:{i} holds a lone surrogate (an escape like \\ud800), not text; fix "
                                        "or drop that line")
                    docs.append(text)
        except UnicodeDecodeError as e:
            raise DataError(f"{fn} is not UTF-8 text ({e.reason} at byte {e.start})")
        except (OSError, EOFError) as e:  # gzip: not a gzip file, or cut short
            raise DataError(f"{fn} cannot be read ({e}); is it complete?")
    if not any(d.strip() for d in docs):
        raise DataError(f"--input={path} holds no text")
    return {'all': docs}


def pubmed(path):
    """PubMedQA's ori_pqal.json: {pmid: {CONTEXTS: [abstract sections], LONG_ANSWER: conclusion, ...}}."""
    try:
        entries = json.load(open(path, encoding='utf-8'))
        docs = ['\n'.join(e['CONTEXTS'] + [e['LONG_ANSWER']]) for e in entries.values()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path} is not PubMedQA's ori_pqal.json ({type(e).__name__})")
    return {'all': docs}


def wikitext(name, zpath):
    try:
        with zipfile.ZipFile(zpath) as z:
            if z.testzip() is not None:  # CRC check of every member
                raise zipfile.BadZipFile('CRC mismatch')
            read = lambda s: z.read(CORPORA[name]['prefix'] + f'wiki.{s}.raw').decode('utf-8')
            return {'train': [read('train')], 'val': [read('valid')], 'test': [read('test')]}
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"{zpath} is not the expected WikiText archive ({e}); delete it and run again")


MIN_TOKENS = 64  # fewer in a split: refused
TOLERANCE = 0.1  # val holds val_fraction of the tokens to within a tenth of itself (0.1: 9% to 11%)


def split_train_val(docs, val_fraction, seed=1337, count=lambda texts: [len(t) for t in texts]):
    """Shuffle documents (fixed seed) and hold out the last val_fraction of the tokens (count: each text's tokens),
    whole documents where that falls within TOLERANCE; else the document at the border is cut in two, at a line's
    start near the cut if there is one."""
    if not 0 < val_fraction < 1:
        raise DataError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    docs = [d for d in docs if d]  # an empty file or record: no document
    if len(docs) > 1:
        random.Random(seed).shuffle(docs)
    sizes = [n + 1 for n in count(docs)]
    total, acc, i = sum(sizes), 0, len(docs)
    target = val_fraction * total
    while i > 1 and acc < target:
        i -= 1
        acc += sizes[i]
    if len(docs) > 1 and abs(acc - target) <= TOLERANCE * target:
        return {'train': docs[:i], 'val': docs[i:]}
    i, rest = len(docs) - 1, target  # val: the last `target` tokens; the cut falls in docs[i]
    while i > 0 and rest > sizes[i]:
        rest -= sizes[i]
        i -= 1
    text, end, after = docs[i], len(docs[i]), 1  # after: the tokens after the cut (1: the end of text)
    lines = text.splitlines(keepends=True)
    for line, n in zip(reversed(lines), reversed(count(lines))):
        if after + n >= rest:  # the cut falls in this line: at its start if that is near, else inside, pro rata
            start = end - len(line)
            cut = start if start and after + n - rest <= TOLERANCE * target else start + round(
                len(line) * (after + n - rest) / n)
            break
        end, after = end - len(line), after + n
    else:
        cut = 0
    return {'train': docs[:i] + [text[:cut]], 'val': [text[cut:]] + docs[i + 1:]}


# -----------------------------------------------------------------------------

def write_dataset(out, corpus, input, name, source, tok, val_fraction, digest):
    """Read and split the source, tokenize each split into a temp file, rename them, then write meta.json."""
    meta_path = os.path.join(out, 'meta.json')
    if corpus == 'pydocs':
        splits = pydocs()
    elif corpus is None:  # a local file or folder
        splits = read_local(input)
    else:  # a named corpus: its file, downloaded into out/, or a local copy
        c = CORPORA[corpus]
        path = input or download(c['url'], os.path.join(out, os.path.basename(c['url'])), c.get('sha256'))
        try:
            if corpus == 'pubmed':
                splits = pubmed(path)
            elif corpus.startswith('wikitext'):
                splits = wikitext(corpus, path)
            else:  # shakespeare: plain text; web: JSON lines, gzipped or not
                splits = read_local(path, jsonl=corpus == 'web')
        except DataError as e:
            raise DataError(f"--input is not the {corpus} corpus's file ({os.path.basename(c['url'])}): {e}; give "
                            f"that file, or your own text with --input=PATH --name=NAME") from None
        if input and c.get('sha256') and os.path.isfile(input) and sha256_of(input) != c['sha256']:
            print(f"warning: {input} is not byte for byte the file {c['url']} (sha256 differs); using it anyway, "
                  f"as it reads as {corpus}'s format")
    if 'all' in splits:
        splits = split_train_val(splits['all'], val_fraction,
                                 count=lambda texts: [sum(map(len, tok['encode'](list(chunks(t))))) for t in texts])
    tmps, counts, sizes = {}, {}, {}
    try:
        for split, docs in splits.items():
            tmps[split] = os.path.join(out, f'{split}.bin.tmp{os.getpid()}')
            counts[split], sizes[split] = write_tokens(tmps[split], docs, tok)
            print(f"{split}: {len(docs):,} document{'s' * (len(docs) != 1)}, {counts[split]:,} tokens, "
                  f"{sizes[split]:,} bytes of text")
            if counts[split] < MIN_TOKENS:
                raise DataError(f"the {split} split would hold only {counts[split]} tokens, too few to train or "
                                f"evaluate on (at least {MIN_TOKENS}); give more text" + (
                                    ' or a larger --val_fraction' if split == 'val' else ''))
        remove(meta_path)  # the old meta must not vouch for new .bin files
        for split, tmp in tmps.items():
            os.replace(tmp, os.path.join(out, f'{split}.bin'))
        for stale in {'train', 'val', 'test'} - set(tmps):
            remove(os.path.join(out, f'{stale}.bin'))
        meta = dict(corpus=corpus or 'local', name=name, source=source, tokenizer=tok['name'],
                    vocab_size=tok['vocab_size'], eot_token=tok['eot'], dtype='uint16', tokens=counts, bytes=sizes,
                    fingerprint=fingerprint({s: os.path.join(out, f'{s}.bin') for s in tmps}),
                    input_sha256=digest,
                    val_fraction=val_fraction if 'test' not in counts else None,
                    val_fraction_measured=round(counts['val'] / sum(counts.values()), 4) if 'test' not in counts
                    else None,
                    separator=f"end-of-text token {tok['eot']} after every document")
        with open(meta_path + '.tmp', 'w') as f:
            json.dump(meta, f, indent=1)
        os.replace(meta_path + '.tmp', meta_path)
    finally:
        for tmp in tmps.values():
            remove(tmp)
    return meta


PREPARED_FROM = dict(tokenizer='--tokenizer', source='the source', input_sha256="the input's content",
                     val_fraction='--val_fraction')  # what makes a preparation another one


def prepare(corpus=None, input=None, name=None, tokenizer=None, val_fraction=0.1, data_dir='data', force=False):
    if corpus is None and input is None:
        corpus = 'pydocs'
    if corpus is not None and corpus not in CORPORA:
        raise DataError(f"unknown corpus {corpus!r}; choose one of {', '.join(CORPORA)}, or --input=PATH")
    if corpus and input and 'url' not in CORPORA[corpus]:  # nothing to read a local copy of
        raise DataError(f"{corpus} is built in and reads no file; drop --input, or drop {corpus} to prepare your "
                        f"file: --input={input} --name=NAME")
    if name is not None and not name.strip():
        raise DataError("--name is empty; give the dataset's folder name, e.g. --name=mine")
    name = name or corpus or os.path.basename(os.path.normpath(input)).lstrip('.').split('.')[0]
    if not name:
        raise DataError(f"no folder name follows from --input={input}; give one with --name=NAME")
    if name in ('.', '..') or os.path.basename(name) != name or '\\' in name or not name.strip():
        raise DataError(f"--name={name!r} must be a plain folder name ({data_dir}/<name>/), e.g. --name=mine")
    tokenizer = tokenizer or (CORPORA[corpus]['tokenizer'] if corpus else 'bytes')
    if tokenizer not in ('gpt2', 'bytes'):
        raise DataError(f"--tokenizer={tokenizer} is unknown; choose gpt2 or bytes")
    out = os.path.join(data_dir, name)
    source = os.path.abspath(input) if input else CORPORA[corpus].get('url') or CORPORA[corpus]['about']
    meta_path = os.path.join(out, 'meta.json')
    if os.path.isdir(out):  # remove what a killed run (kill -9) left: *.tmp<pid> whose process is gone
        for fn in os.listdir(out):
            stem, _, pid = fn.rpartition('.tmp')
            if stem and pid.isdigit():
                try:
                    os.kill(int(pid), 0)  # no error: alive, another prepare_data.py at work
                except ProcessLookupError:  # its process is gone: debris
                    os.remove(os.path.join(out, fn))
                except (PermissionError, OverflowError):  # alive and another user's; or no pid: not ours
                    pass
    digest = input_sha256(input) if input else None
    if os.path.exists(meta_path) and not force:
        try:
            meta = json.load(open(meta_path))
            whole = all(os.path.getsize(os.path.join(out, f'{s}.bin')) == 2 * n for s, n in meta['tokens'].items())
            same = dict(tokenizer=tokenizer, source=source, input_sha256=digest,
                        val_fraction=val_fraction if meta.get('val_fraction') is not None else None)
            other = [PREPARED_FROM[k] for k, v in same.items() if meta.get(k, v) != v]
        except (ValueError, OSError, TypeError, AttributeError, KeyError):
            whole = False
        if whole and not other:
            print(f"{out} is already prepared ({meta['tokens']} tokens); --force redoes it")
            return meta
        if whole:
            raise DataError(f"{out}/ holds {name} prepared from other input ({' and '.join(other)} "
                            f"{'differ' if len(other) > 1 else 'differs'}); "
                            "--force replaces it (runs trained on it then refuse to resume or evaluate on it), "
                            "or choose another --name")
        print(f"{out} holds an unreadable or unfinished preparation; redoing it")
    tok = get_tokenizer(tokenizer)
    print(f"preparing {name} from {source} with the {tokenizer} tokenizer")
    made = [d for d in (data_dir, out) if not os.path.isdir(d)]  # folders this run creates
    os.makedirs(out, exist_ok=True)
    lock = None
    try:
        lock = lock_folder(out, True, f"{out}/ is being read by a running train.py (or prepared by another "
                                      "prepare_data.py); stop it first, or use another --name")
        meta = write_dataset(out, corpus, input, name, source, tok, val_fraction, digest)
    except BaseException:
        for d in reversed(made):  # leave nothing behind
            if os.path.isdir(d) and not os.listdir(d):
                os.rmdir(d)
        raise
    finally:
        if lock is not None:
            os.close(lock)
    print(f"wrote {out}/: " + ', '.join(f"{s}.bin" for s in meta['tokens']) + ", meta.json")
    return meta


# -----------------------------------------------------------------------------
# the loader: what train.py reads, all checked before any training

def lock_folder(path, exclusive, refusal):
    """flock the dataset's folder: trainers share it, a preparation holds it alone. Returns the lock's descriptor
    (None without fcntl: Windows), or raises DataError(refusal)."""
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise DataError(refusal) from None
    return fd


def load(data_dir, name, block_size):
    """data/<name>/ as prepare() wrote it: (meta, {split: path of its .bin}), all checked, the folder locked
    against re-preparation while this process runs."""
    path = os.path.join(data_dir, name)
    meta_path = os.path.join(path, 'meta.json')
    command = f"python prepare_data.py {name if name in CORPORA else '--input=PATH --name=' + name}"
    command += f" --data_dir={shlex.quote(data_dir)}" * (os.path.normpath(data_dir) != 'data')  # where it looks
    again = f"run {command} --force"
    if not os.path.isfile(meta_path):
        raise DataError(f"{meta_path} not found; prepare the corpus first: {command}")
    lock_folder(path, False, f"{path}/ is being prepared right now; wait for prepare_data.py to finish")
    try:
        meta = json.load(open(meta_path))
        tokens, n_bytes, vocab = meta['tokens'], meta.get('bytes') or {}, meta['vocab_size']
        ok = (isinstance(tokens, dict) and {'train', 'val'} <= set(tokens) <= {'train', 'val', 'test'}
              and all(type(n) is int and n >= 0 for n in tokens.values()) and isinstance(n_bytes, dict)
              and all(type(n) is int for n in n_bytes.values()) and type(vocab) is int and 2 <= vocab <= 65536
              and meta.get('dtype') == 'uint16' and meta.get('tokenizer') in TOKENIZERS
              and (vocab, meta.get('eot_token', TOKENIZERS[meta['tokenizer']][1])) == TOKENIZERS[meta['tokenizer']][:2])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise DataError(f"{meta_path} is corrupt (it needs train and val token counts, uint16 tokens, and the "
                        f"vocab_size and end-of-text token of its tokenizer, bytes or gpt2); {again}")
    meta['bytes'] = n_bytes
    splits = {}
    for split, n in tokens.items():
        fn = os.path.join(path, f'{split}.bin')
        if not os.path.isfile(fn):
            raise DataError(f"{fn} is missing or not a file; {again}")
        if os.path.getsize(fn) != 2 * n:
            raise DataError(f"{fn} has {os.path.getsize(fn):,} bytes, not the {n:,} uint16 tokens meta.json lists; "
                            f"it is truncated or corrupt: {again}")
        if n < block_size + 2:
            raise DataError(f"{fn} has only {n} tokens, fewer than block_size+2 = {block_size + 2}; lower --block_size")
        data = np.memmap(fn, dtype=np.uint16, mode='r')
        if data.max() >= vocab:
            raise DataError(f"{fn} holds token ids >= vocab_size {vocab}; it does not match meta.json: {again}")
        text, most = n - np.count_nonzero(data == TOKENIZERS[meta['tokenizer']][1]), TOKENIZERS[meta['tokenizer']][2]
        if split in n_bytes and not text <= n_bytes[split] <= most * text:  # each token of text: 1 to `most` bytes
            raise DataError(f"{meta_path} lists {n_bytes[split]:,} bytes of text for {split}, but its {text:,} "
                            f"tokens of text ({meta['tokenizer']}) hold {text:,}"
                            + (f" to {most * text:,}" if most > 1 else '') + f"; bits per byte would be wrong: {again}")
        splits[split] = fn
    meta['fingerprint'], listed = fingerprint(splits), meta.get('fingerprint')
    if listed not in (None, meta['fingerprint']):
        raise DataError(f"{path}/'s token files are not those meta.json lists (their fingerprint differs): they "
                        f"changed after preparation; {again}")
    return meta, splits


def windows(path, block_size, rank=0, world_size=1, n=64):
    """Every token of a split once, in non-overlapping windows of block_size (the last one shorter): (x, y) int64
    arrays of up to n windows; under DDP each rank takes every world_size-th."""
    data = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    starts = list(range(0, len(data) - 1, block_size))[rank::world_size]
    full = [i for i in starts if i + block_size < len(data)]
    last = starts[len(full):]
    for group in [full[b:b + n] for b in range(0, len(full), n)] + [last] * bool(last):
        size = min(block_size, len(data) - 1 - group[0])
        yield np.stack([data[i:i + size] for i in group]), np.stack([data[i + 1:i + 1 + size] for i in group])


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        sys.exit(f"error: {message}; see python prepare_data.py --help")


if __name__ == '__main__':
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('corpus', nargs='?', help=f"one of {', '.join(CORPORA)} (default pydocs)")
    p.add_argument('--input', help="a local copy of the corpus's file; with no corpus: any .txt/.jsonl/.jsonl.gz "
                                   "file or folder of them")
    p.add_argument('--name', help='dataset name, data/<name>/ (default: the corpus or input file name)')
    p.add_argument('--tokenizer', choices=['gpt2', 'bytes'], help='default: gpt2 for wikitext, bytes otherwise')
    p.add_argument('--val_fraction', type=float, default=0.1, help='held out when a corpus has no val split')
    p.add_argument('--data_dir', default='data')
    p.add_argument('--force', action='store_true', help='redo a finished preparation')
    args = p.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here a Ctrl-C removes what was begun
    try:
        prepare(**vars(args))  # the flags are prepare()'s arguments
    except DataError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # a full disk, a read-only folder
        sys.exit(f"error: cannot write {e.filename or args.data_dir} ({e.strerror or e}); nothing partial was kept: "
                 "free some space or choose another --data_dir")
    except KeyboardInterrupt:
        print("interrupted: no partial output was kept; run the same command again", file=sys.stderr)
        sys.exit(130)
