"""The gap against model size: standard and coupled at three sizes on the WikiText text, seeds 1-3, 500 iterations of
16 x 128 tokens (about one epoch). tiny (4 x 128) reuses results/paper_corpora.py's runs. At the middle size (4 x 256)
and at small (6 x 384) standard's learning rate is picked from 1e-3, 2e-3 and 4e-3 with seed 1 (min_lr a tenth),
and both variants train at it. Then the table and the picture (results/sizes.png).
Run from the repository root, after results/paper_corpora.py: python results/sizes.py"""
import report
import runner
from laptop import P

SIZES = {'middle': '--n_layer=4 --n_head=4 --n_embd=256', 'small': '--preset=small'}
RATES = ('1e-3', '2e-3', '4e-3')


def run(size, lr, attn, seed):  # (out_dir, flags)
    return (f"runs/sizes/{size}/lr-{lr}/{attn}-s{seed}", f"--dataset=wikitext {SIZES[size]} --seed={seed} "
            f"--attn={attn} {P} --learning_rate={lr} --min_lr={float(lr) / 10:g}")


PICK = [run(size, lr, 'standard', 1) for size in ('small', 'middle') for lr in RATES]  # the slowest first


def picked(size):  # the rate of standard's best seed-1 run at this size: its lowest full-split val perplexity
    ppl = {}
    for lr in RATES:
        final = report.done(report.load_runs([run(size, lr, 'standard', 1)[0]]))
        if final:
            ppl[lr] = final[0]['final']['val_ppl']
    return min(ppl, key=ppl.get) if len(ppl) == len(RATES) else None


def jobs():  # the runs at each size's picked rate (standard seed 1 is its pick's run)
    return [run(size, picked(size), attn, s) for size in SIZES for attn in ('standard', 'coupled') for s in (1, 2, 3)
            if picked(size) and (attn, s) != ('standard', 1)]


if __name__ == '__main__':
    runner.run(PICK)
    runner.run(jobs())
