"""The mechanism: attention's entropy, sink and gap at the final eval, per variant, in the seed-variance runs, the
5,000-iteration runs and the free force's (euler-mlp) 2e-3 runs. Their runs are those of seeds.py, long.py and
stability.py (made here if missing). Run from the repository root: python results/mechanism.py"""
import report
import runner
from long import JOBS as LONG
from seeds import JOBS as SEEDS
from stability import JOBS as LR

E = [f"runs/claims/lr/euler-mlp-2e-3-s{s}" for s in (1, 2, 3)]
LONG = [j for j in LONG if '-2.4x-' not in j[0]]  # the 5,000-iteration pair

if __name__ == '__main__':
    runner.run(SEEDS + LONG + [j for j in LR if j[0] in E])
    report.report(['runs/claims/seeds', *(out for out, _ in LONG), *E])
