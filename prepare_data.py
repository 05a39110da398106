"""
Turn a corpus into token files for train.py: data/<name>/{train,val[,test]}.bin (uint16) and meta.json.

  python prepare_data.py                          # pydocs: offline, Python's own docs, byte tokens
  python prepare_data.py shakespeare              # Tiny Shakespeare (download, 1 MB)
  python prepare_data.py pubmed                   # 1,000 PubMed abstracts (download, 2.6 MB): the paper's domain text
  python prepare_data.py web                      # 1,000 C4 web pages (download, 0.9 MB): the paper's web text
  python prepare_data.py wikitext103              # the paper's corpus (download, 190 MB zip), GPT-2 tokens
  python prepare_data.py --input=PATH --name=NAME # any local .txt/.jsonl/.jsonl.gz file, or a folder of them

Each document ends with an end-of-text token: <|endoftext|> (50256) for gpt2, 256 for bytes. meta.json is written
last, so a folder with one is whole; finished work is redone only with --force.
"""
import argparse
import ast
import gzip
import hashlib
import json
import os
import random
import shlex
import sys
import sysconfig
import urllib.request
import zipfile

import numpy as np

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
    """A plausible mistake (no data prepared, a failed download, a file of the wrong kind): reported as one line."""


# -----------------------------------------------------------------------------
# tokenizers: text -> uint16 token arrays

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

def download(url, dest, sha256=None):
    """Fetch url to dest (through a temp file), with progress and a checksum check."""
    if os.path.exists(dest):
        return dest
    req = urllib.request.Request(url, headers={'User-Agent': 'coupled-qk-prepare-data/1.0 (python urllib)'})
    try:
        with urllib.request.urlopen(req, timeout=30) as r, open(dest + '.tmp', 'wb') as f:
            total, got = int(r.headers.get('Content-Length') or 0), 0
            while block := r.read(1 << 20):
                got += f.write(block)
                print(f"\rdownloading {url}: {got / 1e6:.1f}" + (f"/{total / 1e6:.1f}" if total else '') + " MB",
                      end='', flush=True)
        print()
    except OSError as e:
        raise DataError(f"cannot download {url} ({getattr(e, 'reason', e)}); offline, give a copy of it with "
                        f"--input=<path to {os.path.basename(url)}>, or use pydocs (built in)")
    if sha256 and sha256_of(dest + '.tmp') != sha256:
        raise DataError(f"{url} does not have the expected sha256; the file changed upstream")
    os.replace(dest + '.tmp', dest)
    return dest


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
    return hashlib.sha256(''.join(f"{os.path.relpath(fn, path)}:{sha256_of(fn)}\n"
                                  for fn in input_files(path)).encode()).hexdigest()


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
            # ast.walk's order (breadth first), through statements only: the docstrings are on defs
            nodes, holds = [tree], (ast.stmt, ast.excepthandler, ast.match_case)
            for n in nodes:
                nodes += [c for c in ast.iter_child_nodes(n) if isinstance(c, holds)]
            parts = [ast.get_docstring(n) for n in nodes
                     if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            text = '\n\n'.join(p for p in parts if p)
            if text:
                docs.append(text)  # one document per module
    n = sum(map(len, docs))
    if n < 100_000:
        raise DataError(f"found only {n} characters of docs in {root}; use --input=PATH")
    return {'all': docs}


JSONL = ('.jsonl', '.jsonl.gz', '.json.gz')  # JSON lines, gzipped or not


def input_files(path):  # --input: a file, or the .txt and JSON-lines files in a folder's tree, in order
    if not os.path.isdir(path):
        return [path]
    files = []
    for d, dirs, fs in os.walk(path, followlinks=True):
        dirs.sort()
        files += [os.path.join(d, f) for f in sorted(fs) if f.endswith(('.txt',) + JSONL)]
    return files


def read_local(path, jsonl=None):
    """A .txt file (one document), a .jsonl[.gz] file (a document per line, field 'text'), or a folder of them;
    jsonl=True/False: JSON lines / plain text whatever the name."""
    docs = []
    for fn in input_files(path):
        opener = gzip.open if fn.endswith('.gz') else open
        try:
            with opener(fn, 'rt', encoding='utf-8-sig') as f:
                if not (fn.endswith(JSONL) if jsonl is None else jsonl):
                    docs.append(f.read())
                    continue
                for i, line in enumerate(f, 1):
                    try:
                        docs += [json.loads(line)['text']] if line.strip() else []
                    except (ValueError, KeyError, TypeError):
                        raise DataError(f"{fn}:{i} is not a JSON object with a string field 'text'")
        except UnicodeDecodeError as e:
            raise DataError(f"{fn} is not UTF-8 text ({e.reason} at byte {e.start})")
    if not any(d.strip() for d in docs):
        raise DataError(f"--input={path} holds no text (.txt, .jsonl or .jsonl.gz files)")
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
    docs = [d for d in docs if d]  # an empty file or record: no document
    if len(docs) > 1:
        random.Random(seed).shuffle(docs)
    sizes = [n + 1 for n in count(docs)]  # each document's tokens and its end-of-text token
    total, acc, i = sum(sizes), 0, len(docs)
    target = val_fraction * total
    # 1. whole documents from the end, until val holds its share: done if that is near enough
    while i > 1 and acc < target:
        i -= 1
        acc += sizes[i]
    if len(docs) > 1 and abs(acc - target) <= TOLERANCE * target:
        return {'train': docs[:i], 'val': docs[i:]}
    # 2. else (one document, or the border's too large) cut docs[i], the one where val's last `target` tokens begin
    i, rest = len(docs) - 1, target
    while i > 0 and rest > sizes[i]:
        rest -= sizes[i]
        i -= 1
    text, end, after = docs[i], len(docs[i]), 1  # after: the tokens after the cut (1: the end of text)
    lines = text.splitlines(keepends=True)
    for line, n in zip(reversed(lines), reversed(count(lines))):
        if after + n >= rest:  # the cut falls in this line: at its start if that is near, else inside, pro rata
            start = end - len(line)
            cut = start
            if not (start and after + n - rest <= TOLERANCE * target):
                cut += round(len(line) * (after + n - rest) / n)
            break
        end, after = end - len(line), after + n
    else:
        cut = 0
    return {'train': docs[:i] + [text[:cut]], 'val': [text[cut:]] + docs[i + 1:]}


# -----------------------------------------------------------------------------

def write_dataset(out, corpus, input, tok, val_fraction):
    """Read and split the source, write each split's tokens (through a temp file); returns what meta.json records."""
    if corpus == 'pydocs':
        splits = pydocs()
    elif corpus is None:  # a local file or folder
        splits = read_local(input)
    else:  # a named corpus: its file, downloaded into out/, or a local copy
        c = CORPORA[corpus]
        path = input or download(c['url'], os.path.join(out, os.path.basename(c['url'])), c.get('sha256'))
        if input and c.get('sha256') and sha256_of(input) != c['sha256']:  # a local copy of another file: said
            print(f"warning: {input} is not byte for byte {c['url']} (its sha256 differs); using it anyway")
        if corpus == 'pubmed':
            splits = pubmed(path)
        elif corpus.startswith('wikitext'):
            splits = wikitext(corpus, path)
        else:  # shakespeare: plain text; web: JSON lines
            splits = read_local(path, jsonl=corpus == 'web')
    if 'all' in splits:
        splits = split_train_val(splits['all'], val_fraction,
                                 count=lambda texts: [sum(map(len, tok['encode'](list(chunks(t))))) for t in texts])
    counts, sizes = {}, {}
    for split, docs in splits.items():
        counts[split], sizes[split] = write_tokens(os.path.join(out, f'{split}.bin.tmp'), docs, tok)
        print(f"{split}: {len(docs):,} document{'s' * (len(docs) != 1)}, {counts[split]:,} tokens, "
              f"{sizes[split]:,} bytes of text")
        if counts[split] < MIN_TOKENS:
            raise DataError(f"the {split} split would hold only {counts[split]} tokens, too few to train or evaluate "
                            f"on (at least {MIN_TOKENS}); give more text"
                            + ' or a larger --val_fraction' * (split == 'val'))
    for split in splits:
        os.replace(os.path.join(out, f'{split}.bin.tmp'), os.path.join(out, f'{split}.bin'))
    return dict(tokens=counts, bytes=sizes, fingerprint=fingerprint({s: os.path.join(out, f'{s}.bin') for s in splits}),
                val_fraction=val_fraction if 'test' not in counts else None,  # (wikitext: its own splits)
                val_fraction_measured=round(counts['val'] / sum(counts.values()), 4) if 'test' not in counts else None)


def prepare(corpus=None, input=None, name=None, tokenizer=None, val_fraction=0.1, data_dir='data', force=False):
    if corpus is None and input is None:
        corpus = 'pydocs'
    if corpus is not None and corpus not in CORPORA:
        raise DataError(f"unknown corpus {corpus!r}; choose one of {', '.join(CORPORA)}, or --input=PATH")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    if input and not os.path.exists(input):
        raise DataError(f"--input={input} does not exist; give a .txt/.jsonl/.jsonl.gz file or a folder of them")
    name = name or corpus or os.path.basename(os.path.normpath(input)).split('.')[0]
    tokenizer = tokenizer or (CORPORA[corpus]['tokenizer'] if corpus else 'bytes')
    out, meta_path = os.path.join(data_dir, name), os.path.join(data_dir, name, 'meta.json')
    source = os.path.abspath(input) if input else CORPORA[corpus].get('url') or CORPORA[corpus]['about']
    asked = dict(tokenizer=tokenizer, source=source, input_sha256=input_sha256(input) if input else None,
                 val_fraction=val_fraction)  # what makes a preparation another one
    if os.path.exists(meta_path) and not force:
        meta = json.load(open(meta_path))
        other = [k for k, v in asked.items() if meta.get(k, v) not in (v, None)]  # (wikitext's val_fraction: None)
        if other:
            raise DataError(f"{out}/ holds {name} prepared otherwise ({' and '.join(other)} "
                            f"{'differ' if other[1:] else 'differs'}); --force replaces it (runs trained on it then "
                            "refuse to resume or evaluate on it), or choose another --name")
        print(f"{out} is already prepared ({meta['tokens']} tokens); --force redoes it")
        return meta
    tok = get_tokenizer(tokenizer)
    print(f"preparing {name} from {source} with the {tokenizer} tokenizer")
    os.makedirs(out, exist_ok=True)
    if os.path.exists(meta_path):  # --force: the old record must not vouch for new token files
        os.remove(meta_path)
    meta = dict(name=name, corpus=corpus or 'local', **asked, vocab_size=tok['vocab_size'], dtype='uint16',
                separator=f"end-of-text token {tok['eot']} after every document")
    meta |= write_dataset(out, corpus, input, tok, val_fraction)
    with open(meta_path + '.tmp', 'w') as f:
        json.dump(meta, f, indent=1)
    os.replace(meta_path + '.tmp', meta_path)  # last: a folder with a meta.json is whole
    print(f"wrote {out}/: " + ', '.join(f"{s}.bin" for s in meta['tokens']) + ", meta.json")
    return meta


# -----------------------------------------------------------------------------
# what train.py reads

def load(data_dir, name, block_size):
    """data/<name>/ as prepare() wrote it: (meta, {split: path of its .bin})."""
    path = os.path.join(data_dir, name)
    command = f"python prepare_data.py {name if name in CORPORA else '--input=PATH --name=' + name}" + (
        f" --data_dir={shlex.quote(data_dir)}" * (os.path.normpath(data_dir) != 'data'))  # where train.py looks
    if not os.path.isfile(os.path.join(path, 'meta.json')):
        raise DataError(f"{os.path.join(path, 'meta.json')} not found; prepare the corpus first: {command}")
    meta = json.load(open(os.path.join(path, 'meta.json')))
    splits = {split: os.path.join(path, f'{split}.bin') for split in meta['tokens']}
    short = [s for s, n in meta['tokens'].items() if n < block_size + 2]
    if short:
        raise DataError(f"{name}'s {short[0]} split has only {meta['tokens'][short[0]]} tokens, fewer than "
                        f"--block_size={block_size} + 2; lower --block_size")
    meta['bytes'] = meta.get('bytes') or {}  # (older: none, no bits per byte)
    meta['fingerprint'] = meta.get('fingerprint') or fingerprint(splits)
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
    try:
        prepare(**vars(p.parse_args()))  # the flags are prepare()'s arguments
    except DataError as e:
        sys.exit(f"error: {e}")
