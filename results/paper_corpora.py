"""The paper's own corpora at laptop scale: 48 runs of the laptop protocol (results/laptop.py: tiny, bytes, 500
iterations, seeds 1-3) on WikiText and PubMed, then their table. WikiText here is the raw text of WikiText-2's test
split (wiki.test.raw), read from $CORPORA_DIR/wikitext-2-raw/; PubMed is prepare_data.py's built-in `pubmed`.
Run from the repository root: CORPORA_DIR=<folder> python results/paper_corpora.py"""
import os
import sys

import report
import runner
from laptop import P

VARIANTS = ('standard', 'coupled', 'euler', 'coupled-mlp', 'uncoupled', 'invertible')
JOBS = []
for d in ('wikitext', 'pubmed'):
    for s in (1, 2, 3):
        JOBS += [(f"runs/laptop/{d}/{a}-s{s}", f"--dataset={d} --seed={s} --attn={a} {P}") for a in VARIANTS]
        JOBS += [(f"runs/laptop/{d}/standard-{name}-s{s}", f"--dataset={d} --seed={s} {P} --max_iters={n}")
                 for name, n in (('matched', 610), ('2.4x', 1200))]


def prepare():  # prepare_data.py keeps finished work
    corpora = os.environ.get('CORPORA_DIR', '')
    wiki = os.path.join(corpora, 'wikitext-2-raw', 'wiki.test.raw')
    if not os.path.isfile(wiki):
        sys.exit(f"error: no {wiki}; set CORPORA_DIR to a folder that holds wikitext-2-raw/wiki.test.raw, the raw "
                 "text of WikiText-2's test split")
    pubmed = os.path.join(corpora, 'pubmed', 'ori_pqal.json')  # else downloaded
    runner.prepare(f'--input={wiki}', '--name=wikitext', '--tokenizer=bytes')
    runner.prepare('pubmed', *[f'--input={pubmed}'] * os.path.isfile(pubmed))


if __name__ == '__main__':
    runner.run(JOBS, prepare)
    report.report(['runs/laptop/wikitext', 'runs/laptop/pubmed'], plot='results/curves-paper-corpora.png')
