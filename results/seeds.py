"""Seed variance: standard, coupled and uncoupled with seeds 1-10 and invertible with 1-3 (500 iterations, pydocs),
then their table with the seed variances and each pair's ratio. Run from the repository root: python results/seeds.py"""
import report
import runner

P = "--dataset=pydocs --max_iters=500 --eval_interval=100 --eval_iters=20 --log_interval=10"  # the claims' protocol
JOBS = [(f"runs/claims/seeds/{a}-s{s}", f"{P} --seed={s} --attn={a}")
        for s in range(1, 11) for a in ('standard', 'coupled', 'uncoupled')]
JOBS += [(f"runs/claims/seeds/invertible-s{s}", f"{P} --seed={s} --attn=invertible") for s in (1, 2, 3)]

if __name__ == '__main__':
    runner.run(JOBS)
    report.report(['runs/claims/seeds'])
