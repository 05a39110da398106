"""Results at laptop scale: 99 runs of 500 iterations (standard-matched 610, standard-2.4x 1,200), three corpora,
seeds 1-3, then their table and curves (results/curves.png). Run from the repository root: python results/laptop.py"""

import report
import runner

P = "--max_iters=500 --eval_interval=100 --eval_iters=20 --log_interval=100"
VARIANTS = ('standard', 'coupled', 'euler', 'symplectic-euler', 'euler-mlp', 'coupled-mlp', 'uncoupled', 'invertible')
PYDOCS_ONLY = (('diff', '--attn=diff'), ('diff+coupled', '--attn=diff+coupled'),
               ('coupled-steps7', '--attn=coupled --qk_steps=7'))
JOBS = []
for d in ('pydocs', 'shakespeare', 'web'):
    for s in (1, 2, 3):
        JOBS += [(f"runs/laptop/{d}/{a}-s{s}", f"--dataset={d} --seed={s} --attn={a} {P}") for a in VARIANTS]
        JOBS += [(f"runs/laptop/{d}/standard-{name}-s{s}", f"--dataset={d} --seed={s} {P} --max_iters={n}")
                 for name, n in (('matched', 610), ('2.4x', 1200))]
JOBS += [(f"runs/laptop/pydocs/{n}-s{s}", f"--dataset=pydocs --seed={s} {P} {flags}")
         for s in (1, 2, 3) for n, flags in PYDOCS_ONLY]

if __name__ == '__main__':
    runner.run(JOBS, lambda: [runner.prepare(corpus) for corpus in ('pydocs', 'shakespeare', 'web')])
    report.report(['runs/laptop'], plot='results/curves.png')
