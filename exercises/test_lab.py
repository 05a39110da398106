"""The lab (exercises/): each script run as a student runs it, from the repository root, and held to the numbers
WORKSHEET.md's "Look for" paragraphs state and to the numbers and formulas ANSWERS.md states. It runs the scripts with
test_model.py's harness and reuses its claims' measurements. Run from the repository root: python -m pytest -q -k lab
"""
import dataclasses
import importlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's scripts
import model as M  # noqa: E402
from model import FORCES, INTEGRATORS, QK_TRANSFORMS, GPT, GPTConfig, Hamiltonian, Integrator, qk_diagnostics
import test_model as T
from test_model import (CLAIMS, HERE, SMALL, Elementwise, Pendulum, build, counted_and_priced_matmul_flops, entry_map,
                        hamiltonian, idx_batch, jacobian_det, measure, one_head, one_line_error, qk_pair, run, start,
                        yoshida)
from test_model import corpus, no_run_outlives_the_tests, seeded  # noqa: F401  (fixtures, shared)


LAB = os.path.join(HERE, 'exercises')
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None\n"
ADD_MINE = (f"import sys; sys.path.insert(0, {HERE!r}); import model\n"  # as `cat exercises/ex6_mine.py >> model.py`
            f"exec(open({os.path.join(LAB, 'ex6_mine.py')!r}).read(), vars(model))\n")
DKD_STEP = '''
def dkd(h, q, k, dt):  # drift-kick-drift: 1 force, 5 vector ops a step
    q = q + dt / 2 * k
    k = k + h.force(q, dt)
    return q + dt / 2 * k, k
'''  # exercise 6's reference step: its Look for states what exercise 1 prints for it, and its cost
ADD_DKD = (f"import sys; sys.path.insert(0, {HERE!r}); import model\n"  # the reference as the student's `mine`
           f"exec({DKD_STEP!r}, vars(model))\n"
           "model.INTEGRATORS['mine'] = model.Integrator(model.dkd, True, True, True, order=2, forces=1, vector_ops=5)\n")
LAB_RUNS = {  # name: (script and its arguments, python run first)
    1: (('ex1_pendulum.py',), ''), 2: (('ex2_jacobian.py', 'mine'), ADD_MINE),
    6: (('ex1_pendulum.py', 'leapfrog', 'mine'), ADD_DKD),
    3: (('ex3_scores.py',), ''), 4: (('ex4_linear_regime.py',), ''),
    5: (('ex5_learned.py', 'exercises/quickstart'), ''),
    '3 without matplotlib': (('ex3_scores.py',), NO_MATPLOTLIB),
    '5 without matplotlib': (('ex5_learned.py', 'exercises/quickstart'), NO_MATPLOTLIB)}


def lab_text(name):
    return open(os.path.join(LAB, name), encoding='utf-8').read()


def lab_section(n, text):
    """Exercise n's section (or 'Discussion') of WORKSHEET.md or ANSWERS.md, on one line."""
    return ' '.join(re.split(r'\n## ', text.split(f'\n## {n}' + ('. ' if isinstance(n, int) else ''))[1])[0].split())


@pytest.fixture(scope='module')
def lab(corpus, tmp_path_factory):
    """{run: (what it printed, its traceback or '')} for LAB_RUNS, each a process of its own in a folder laid out as
    the repository after the quick start's prepare_data.py (data/pydocs); the launcher's run too ('launcher')."""
    root = tmp_path_factory.mktemp('lab')
    os.makedirs(root / 'data')
    os.symlink(os.path.join(corpus, 'pydocs'), root / 'data' / 'pydocs')
    os.symlink(LAB, root / 'exercises')  # the lab's copy of a quick-start run is exercises/quickstart

    def one(key):
        (script, *args), patch = LAB_RUNS[key]
        r = run(os.path.join(LAB, script), *args, cwd=root, patch=patch, timeout=300)
        return key, (r.stdout, r.stderr if r.returncode else '')

    def launcher():  # exercise 6: the template appended to (a copy of) model.py, then a tiny run of it
        repo = tmp_path_factory.mktemp('repo')
        for name in ('train.py', 'bench.py', 'prepare_data.py', 'model.py'):
            shutil.copy(os.path.join(HERE, name), repo / name)
        with open(repo / 'model.py', 'a') as f:
            f.write(lab_text('ex6_mine.py'))
        os.makedirs(repo / 'exercises')
        shutil.copy(os.path.join(LAB, 'ex6_train.py'), repo / 'exercises')
        train = lambda: run(repo / 'exercises' / 'ex6_train.py', 'mine', '--seeds', '1', '--',  # noqa: E731
                            f'--data_dir={corpus}', *SMALL, '--n_embd=32', '--max_iters=2', '--eval_interval=2',
                            cwd=repo, timeout=300)
        r = train()
        again = [train()]  # unchanged: kept (what is retrained when, the stub launcher tests)
        return 'launcher', (r.stdout, r.stderr if r.returncode else r.stderr + '(exit 0)', repo, again)
    with ThreadPoolExecutor(2) as pool:  # two cores
        jobs = [pool.submit(launcher), *(pool.submit(one, key) for key in (1, 4, 2, 3, 5, 6, '3 without matplotlib',
                                                                            '5 without matplotlib'))]
        return dict(job.result() for job in jobs) | {'root': root}


def lab_output(lab, key):
    out, error = lab[key][:2]
    assert error == '', error[-2000:]
    return out


def test_lab_is_laid_out_and_fits_90_minutes():
    worksheet, answers = lab_text('WORKSHEET.md'), lab_text('ANSWERS.md')
    minutes = re.findall(r'\n\| [^|]+ \| (\d+) \| [^|]+ \|', worksheet.split('\n## ')[0])
    assert len(minutes) == 9 and sum(map(int, minutes)) == 90  # the quick start, the pre-read, six exercises, discussion
    # the pre-read: a page (under 10 minutes at about 150 words a minute) of the words, the variants, the trap
    pre = worksheet.split('\n## Pre-read (')[1].split('\n## ')[0]
    assert int(pre.split(' minutes)')[0]) == int(minutes[1]) and len(pre.split()) < 150 * int(minutes[1])
    assert all(f'`{name}`' in pre for name in ('standard', 'coupled', 'euler', 'coupled-mlp'))
    assert all(word in pre for word in ('*symplectic*', '*symmetric*', '*order*', '*spread*', '*free force*',
                                        'linear-regime trap', '*nonlinear fraction*'))
    for n in range(1, 7):
        section = lab_section(n, worksheet)
        assert all(part in section for part in ('**Predict first.**', '**Run**', '**Look for:**')), n
        assert len(lab_section(n, answers)) > 300, n  # an answer, and how to judge one
        for script in re.findall(r'python (exercises/\S+\.py)', section) + re.findall(r'cat (exercises/\S+)', section):
            assert os.path.exists(os.path.join(HERE, script)), script
    assert lab_section('Discussion', worksheet).endswith('?') and 'A good answer' in lab_section('Discussion', answers)
    assert all(re.search(rf'\b[Cc]orrection {c}\b', answers) for c in 'ABCDEFG')  # each fix of the first version
    assert 'Start the quick start now' in worksheet.split('\n## 1. ')[0]  # the long run first
    # exercise 6 trains in the laptop results' protocol, so its rows compare with the table's; the README points here
    readme = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read()
    laptop = open(os.path.join(HERE, 'results', 'laptop.md'), encoding='utf-8').read()
    launcher = open(os.path.join(LAB, 'ex6_train.py')).read()
    assert re.search(r'PROTOCOL = "(.*?)"', launcher).group(1) == re.search(r'\nP="(.*?)"\n', laptop).group(1)
    assert all(f'exercises/{name}' in readme for name in ('WORKSHEET.md', 'ANSWERS.md'))
    assert readme.index('\n## Glossary\n') < readme.index('\n## Classroom exercises\n')  # words before their use
    # the discussion's numbers are the results': the paper's gain, standard-2.4x's lead, the nonlinear fractions
    discussion = lab_section('Discussion', answers)
    assert 'gains 6.6% at 60M' in lab_section('Discussion', worksheet) and '-6.6% validation perplexity' in readme
    results = laptop  # the laptop table, in full
    row = lambda name: re.search(rf'\n\| `{re.escape(name)}` \| (.*)', results).group(1)  # noqa: E731
    lead = float(re.search(r'\((-[\d.]+)%\)', row('standard-2.4x')).group(1))
    assert f"`standard-2.4x` is {-lead:.0f}% better" in discussion
    nonlinear = lambda name: [float(x) for x in re.search(r'([\d.]+)-([\d.]+)% \|$', row(name)).groups()]  # noqa
    low, high = map(int, re.search(r'nearly linear \((\d+)% to (\d+)%', discussion).groups())
    assert (low, high) == (math.floor(nonlinear('coupled')[0]), math.ceil(nonlinear('coupled')[1]))
    helped = [x for name in ('uncoupled', 'invertible') for x in nonlinear(name)]
    low, high = map(int, re.search(r'the maps that helped reach (\d+)% to (\d+)%', discussion).groups())
    assert (low, high) == (math.floor(min(helped)), math.ceil(max(helped)))


def test_lab_scripts_run_and_draw_their_picture_or_say_how_to_get_it(lab):
    drawn = importlib.util.find_spec('matplotlib') is not None  # the scripts draw where matplotlib imports
    for key in (1, 2, 3, 4, 5):
        out = lab_output(lab, key)
        assert out.strip() and not re.search(r'\bnan\b', out.lower()), key
        picture = re.search(r"savefig\('(\w+\.png)'", open(os.path.join(LAB, LAB_RUNS[key][0][0])).read())
        if picture:
            assert (lab['root'] / picture.group(1)).exists() == drawn, key
            assert out.strip().splitlines()[-1] == (f'drew {picture.group(1)}' if drawn else
                                                    'for the picture: pip install matplotlib'), key
    for key in ('3 without matplotlib', '5 without matplotlib'):
        assert lab_output(lab, key).strip().splitlines()[-1] == 'for the picture: pip install matplotlib'
    r = run(os.path.join(LAB, 'ex5_learned.py'), cwd=lab['root'])  # before the quick start has saved its run
    assert one_line_error(r, 'exercises/quickstart')


# What each number of an exercise's "Look for" paragraph is, in order, read off what its script printed: (the value,
# or values that must all agree, and how close). A number in backticks is code, not a figure. How close:
#   digits:   a printed figure, to the digits the worksheet gives (half a unit in its last place);
#   power2:   a growth factor the worksheet rounds to a power of 2 ("a factor of 4"), within a quarter of a power of 2;
#   order:    the order p of that factor 2^p ("order 2"), within 0.25;
#   roundoff: a rounding error (it moves with the BLAS, the CPU and the torch version), within a factor of 10: two
#             CPUs gave 3e-15 and 1e-14 for one figure; this still tells float32's 1e-07 from float64's 1e-15.
def figures(out, pattern):
    rows = re.findall(pattern, out)
    assert rows, f"the output has no line like {pattern!r}:\n{out}"
    return rows


def exercise_1_rows(out):
    e = {(name, float(dt)): float(err) for name, dt, err in
         figures(out, r'([\w-]+) +dt=([\d.]+): largest energy error (\S+)')}
    halving = {name: ([float(r) for r in re.findall(r'([\d.]+)x', ratios)], float(slope)) for name, ratios, slope in
               figures(out, r'([\w-]+) +each halving of dt from 0.1 divides the error by (.*?); log-log slope (\S+)')}
    long = {name: (float(a), float(b)) for name, a, b in figures(
        out, r'([\w-]+) +10000 steps of dt=0.1: largest energy error (\S+) in the first 1000 steps, (\S+) in the last')}
    det = float(figures(out, r'det J - \(1 \+ dt\^2 cos q\) along the orbit: at most (\S+)')[0])
    return e, halving, long, det


def exercise_1_figures(out):
    e, halving, long, _ = exercise_1_rows(out)
    (leap, leap_slope), (euler, euler_slope) = halving['leapfrog'], halving['euler']
    return [(e['leapfrog', 0.1], 'digits'), (e['leapfrog', 0.05], 'digits'), (leap[0], 'power2'), (leap[0], 'order'),
            (tuple(leap), 'digits'), (leap_slope, 'digits'), (e['euler', 0.1], 'digits'), (e['euler', 0.05], 'digits'),
            (euler[0], 'digits'), (euler[-1], 'power2'), (euler[-1], 'order'), (euler[-1], 'digits'),
            (euler_slope, 'digits'), (long['leapfrog'], 'digits'), (long['euler'][0], 'digits'),
            (long['euler'][1], 'digits')]


def exercise_2_rows(out):  # {(row, dtype): (moved, back, det J min, max, singular values min, max, |..|)}
    number = r'([-+\d.e]+)'
    return {(name, dtype): [float(x) for x in row] for name, dtype, *row in figures(out, (
        rf'([\w-]+) (float\d+): moved {number}, back to {number}; det J {number} to {number}; singular values '
        rf'{number} to {number}; \|J\^T Omega J - Omega\| {number}'))}


def exercise_2_figures(out):
    r = exercise_2_rows(out)
    l32, l64, eu, free = r['leapfrog', 'float32'], r['leapfrog', 'float64'], r['euler', 'float64'], \
        r['free-force', 'float64']
    return [((l32[0], l64[0]), 'digits'), (l32[1], 'roundoff'), (l64[1], 'roundoff'),
            ((*l32[2:4], *l64[2:4]), 'digits'), (l64[6], 'roundoff'), ((l32[5], l64[5]), 'digits'),
            ((l32[4], l64[4]), 'digits'), (eu[1], 'digits'), (eu[2], 'digits'), (eu[3], 'digits'), (eu[6], 'digits'),
            (free[0], 'digits'), (free[1], 'roundoff'), (tuple(free[2:4]), 'digits'), (free[6], 'digits')]


def exercise_3_rows(out):  # [(dt, the scores' change, the formula's error, Euler's difference)], the three slopes
    rows = [tuple(map(float, row)) for row in figures(
        out, r'dt=([\d.]+): scores change by (\S+); off by (\S+) \(the formula\), (\S+) \(Euler\)')]
    slopes = figures(out, r'log-log slopes against dt: (\S+) \(the change\), (\S+) \(the formula.s error\), (\S+) ')
    return rows, [float(s) for s in slopes[0]]


def exercise_3_figures(out):
    rows, slopes = exercise_3_rows(out)
    return [*[(row[1], 'digits') for row in rows], (slopes[0], 'digits'), *[(row[2], 'digits') for row in rows],
            *[(row[3], 'digits') for row in rows], (slopes[1], 'digits'), (slopes[2], 'digits')]


def exercise_4_rows(out):  # {b: [(spread, nonlinear fraction, growth over the last spread or None)]}, {b: slope}
    rows = {}
    for b, s, f, g in figures(out, r'b=([\d.]+) spread ([\d.]+): nonlinear (\S+?)(?:, ([\d.]+)x the last)?\n'):
        rows.setdefault(float(b), []).append((float(s), float(f), float(g) if g else None))
    return rows, {float(b): float(s) for b, s in figures(out, r'b=([\d.]+): log-log slope (\S+)')}


def exercise_4_figures(out):
    rows, slopes = exercise_4_rows(out)
    plain, biased = rows[0.0], rows[0.5]
    return [(plain[0][1], 'digits'), (plain[1][2], 'digits'), (plain[2][2], 'digits'), (slopes[0.0], 'digits'),
            *[(g, 'digits') for _, _, g in plain[3:]], (dict((s, f) for s, f, _ in plain)[2.0], 'digits'),
            (biased[1][2], 'digits'), (biased[2][2], 'digits'), (slopes[0.5], 'digits')]


def exercise_5_rows(out):
    """Per layer (nonlinear %, [dt]); per head (variation, flips, corr, R^2 alone, R^2, the diagonal's score rises,
    its attention falls, the largest score gain is the diagonal's, the largest attention gain is: rows of 48)."""
    layers = [(float(f), [float(x) for x in re.findall(r'[-\d.]+', dt)]) for f, dt in figures(
        out, r'layer \d: nonlinear ([\d.]+)%, dt (\[.*?\])')]
    heads = [tuple(map(float, row)) for row in figures(
        out, r'head \d: total variation (\S+), argmax flips (\d+)/48, corr\(change, k_i.k_j\) (\S+), R\^2 (\S+) '
             r'\(dt k_i.k_j alone\), (\S+) \(first order\)\nhead \d: the diagonal.s score rises in (\d+)/48 rows, '
             r'its attention falls in (\d+)/48; the largest gain is the diagonal.s in (\d+)/48 rows by score, '
             r'(\d+)/48 by attention')]
    return layers, heads


def exercise_5_figures(out):
    layers, heads = exercise_5_rows(out)
    extremes = lambda values: [(min(values), 'digits'), (max(values), 'digits')]  # noqa: E731  a range "a to b"
    column = lambda i: [h[i] for h in heads]  # noqa: E731
    return [(layers[0][0], 'digits'), *extremes([f for f, _ in layers[1:]]),
            *extremes([dt for _, dts in layers for dt in dts]), *extremes(column(0)), *extremes(column(1)),
            (48, 'digits'), *extremes(column(2)), *extremes(column(3)), *extremes(column(4)),
            (tuple(column(5)), 'digits'), *extremes(column(6)), *extremes(column(7)), (48, 'digits'),
            *extremes(column(8))]


def exercise_6_figures(out):  # the reference drift-kick-drift: its cost, counted, and exercise 1's lines for it
    e, halving, _, _ = exercise_1_rows(out)
    (ratios, slope), dkd = halving['mine'], lab_step('dkd')
    return [(counted_cost(dkd)[0], 'digits'), (counted_cost(dkd)[1], 'digits'), (e['mine', 0.1], 'digits'),
            (e['mine', 0.05], 'digits'), (e['leapfrog', 0.1], 'digits'), (e['leapfrog', 0.05], 'digits'),
            (tuple(ratios), 'digits'), (slope, 'digits')]


LOOK_FOR = {1: exercise_1_figures, 2: exercise_2_figures, 3: exercise_3_figures, 4: exercise_4_figures,
            5: exercise_5_figures, 6: exercise_6_figures}
NUMBER = re.compile(r'(?<![\w.^])\d+(?:\.\d+)?(?:e[-+]\d+)?')


def stated(paragraph):
    """The numbers a paragraph states outside `code`: [(start, end, text)], positions in the paragraph."""
    prose = re.sub(r'`[^`]*`', lambda m: ' ' * len(m.group()), paragraph)
    return [(m.start(), m.end(), m.group()) for m in NUMBER.finditer(prose)]


def close(text, value, how):
    x = float(text)
    if how == 'digits':
        mantissa, _, exponent = text.partition('e')
        decimals = len(mantissa.partition('.')[2])
        return abs(x - value) <= 0.5 * 10.0 ** (int(exponent or 0) - decimals) * (1 + 1e-9)
    if how == 'power2':
        return abs(math.log2(x) - math.log2(value)) <= 0.25
    if how == 'order':
        return abs(x - math.log2(value)) <= 0.25
    assert how == 'roundoff', how
    return 1 / 10 <= x / value <= 10


def look_for(n, text=None):  # the paragraph, up to its picture or the next bold heading (exercise 6's homework)
    return lab_section(n, text or lab_text('WORKSHEET.md')).split('**Look for:** ')[1].split(' ![')[0].split(' **')[0]


def look_for_mismatches(n, out, text=None):
    """Where exercise n's "Look for" paragraph in WORKSHEET.md (or `text`) disagrees with what its script printed."""
    numbers, expected = stated(look_for(n, text)), LOOK_FOR[n](out)
    if len(numbers) != len(expected):
        return [f"exercise {n}'s Look for states {len(numbers)} numbers, its check reads {len(expected)}: "
                f"{[t for _, _, t in numbers]}"]
    return [f"exercise {n}: the worksheet says {text}, the script gives {values} ({how})"
            for (_, _, text), (values, how) in zip(numbers, expected)
            if not all(close(text, v, how) for v in (values if isinstance(values, tuple) else (values,)))]


@pytest.mark.parametrize('n', sorted(LOOK_FOR))
def test_lab_look_for_states_what_its_script_prints(lab, n):
    assert look_for_mismatches(n, lab_output(lab, n)) == []


def test_lab_look_for_check_fails_when_a_worksheet_number_changes(lab):
    # on a scratch copy of WORKSHEET.md: change a number of a "Look for" paragraph (its first by a digit, then each
    # by 20x) and the check above fails
    worksheet = lab_text('WORKSHEET.md')
    for n in LOOK_FOR:
        out, paragraph = lab_output(lab, n), look_for(n)
        numbers = stated(paragraph)
        start, end, text = numbers[0]
        first = re.search(r'[1-9]', text)  # its first significant digit, one up (9: down to 1)
        changed = text[:first.start()] + str(int(first.group()) % 9 + 1) + text[first.end():]
        for start, end, changed in [(start, end, changed)] + [(s, e, f"{20 * float(t):g}") for s, e, t in numbers
                                                           if float(t)]:  # (20 x 0 is 0)
            scratch = ' '.join(worksheet.split()).replace(paragraph, paragraph[:start] + changed + paragraph[end:])
            assert look_for_mismatches(n, out, scratch.replace(' ## ', '\n## ')), (n, changed)


def formula(text, **names):
    """A formula as ANSWERS.md writes it, evaluated: `dt^2/2 F(q)` is dt**2/2*F(q), `|k|` a norm, `a . b` a dot
    product, `cos q` cos(q); names: its symbols' values."""
    py = re.sub(r'\b(cos|sin) (\w+)', r'\1(\2)', text)
    py = re.sub(r'\|([^|]+)\|', r'norm(\1)', py).replace('^', '**').replace(' . ', ' @ ')
    py = re.sub(r'(?<=[\w)]) +(?=[\w(])', '*', py)  # juxtaposition: a product
    return eval(py, {'__builtins__': {}, 'norm': torch.linalg.vector_norm, 'cos': math.cos, 'sqrt': math.sqrt}, names)


def stated_formula(pattern, answer):  # the formula a pattern's group finds in an answer
    found = re.search(pattern, answer)
    assert found, f"no {pattern!r} in the answer"
    return found.group(1)


def number_in(pattern, answer):
    return float(stated_formula(pattern, answer))


class Spring(Hamiltonian):  # V(q) = c q^2/2, F(q) = -c q
    c = 1.0

    def force(self, q, scale=1.0):
        return -scale * self.c * q


def spring(integrator, dt, c=1.0, steps=1):
    h = type('Spring', (Spring,), dict(c=c))(1, 1, 1, steps, integrator, dt=dt).double()
    with torch.no_grad():
        h.dt.fill_(dt)
    return h


def energy_error(h, H, steps):
    """The largest |H(q, k) - H0| over `steps` calls of h (one head of one dimension) from rest at q = 1; |q| at the
    end."""
    q, k = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    worst, e0 = 0.0, H(q.item(), k.item())
    with torch.no_grad():
        for _ in range(steps):
            q, k = h(q, k)
            worst = max(worst, abs(H(q.item(), k.item()) - e0))
    return worst, abs(q.item())


def pendulum_energy_error(integrator, dt):  # exercise 1's: the largest |H - H0| to time 20, H = 1/2 k^2 - cos q
    h = Pendulum(1, 1, 1, 1, integrator, dt=dt).double()
    return energy_error(h, lambda q, k: 0.5 * k ** 2 - math.cos(q), round(20 / dt))[0]


def test_lab_answer_1_the_pendulum_holds_its_numbers_and_formulas(lab):
    answer = lab_section(1, lab_text('ANSWERS.md'))
    e, halving, long, det_gap = exercise_1_rows(lab_output(lab, 1))
    # Euler's determinant, exactly: the formula as written against autograd at points far from the bottom
    det = stated_formula(r'exactly `det J = (.*?)`', answer)
    for q, dt in ((1.0, 0.1), (2.5, 0.7), (-0.3, 1.3)):
        h = Pendulum(1, 1, 1, 1, 'euler', dt=dt).double()
        with torch.no_grad():
            h.dt.fill_(dt)
        J = torch.autograd.functional.jacobian(lambda x: torch.cat(h(x[:1].view(1, 1, 1, 1), x[1:].view(
            1, 1, 1, 1)), -1).flatten(), torch.tensor([q, 0.4], dtype=torch.float64))
        assert abs(torch.linalg.det(J).item() - formula(det, dt=dt, q=q)) < 1e-12
    assert det_gap < 1e-12  # and the script's own check along the orbit
    # growing areas are not growing energy: the energy one Euler step adds is the stated Delta H, up to O(dt^3)
    gain = stated_formula(r'`Delta H = (.*?)` up to `O\(dt\^3\)`', answer)
    H = lambda q, k: 0.5 * k ** 2 - math.cos(q)  # noqa: E731
    left = []
    for dt in (0.02, 0.01):
        q, k = 0.7, 0.4
        left.append(abs(H(q + dt * k, k - dt * math.sin(q)) - H(q, k) - formula(gain, dt=dt, q=q, k=k, sin=math.sin)))
    assert 7 < left[0] / left[1] < 9  # third order left over
    # over a swing the gain averages to dt^2 times the mean of sin(q)^2 (k^2 cos q = d/dt (k sin q) + sin(q)^2)
    h, dt = Pendulum(1, 1, 1, 1, 'euler', dt=0.005).double(), 0.005
    q, k, gains, sines = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64), [], []
    with torch.no_grad():
        for _ in range(round(6.70 / dt)):  # one period from rest at 1 radian
            q1, k1 = h(q, k)
            gains.append(H(q1.item(), k1.item()) - H(q.item(), k.item()))
            sines.append(math.sin(q.item()) ** 2)
            q, k = q1, k1
    assert abs(sum(gains) / (dt ** 2 * sum(sines)) - 1) < 0.05
    assert 'spirals out' in answer and 'does not close' in answer
    # leapfrog conserves the stated modified energy of the spring exactly (to rounding), not H
    energy = stated_formula(r'modified energy `(.*?)` exactly', answer)
    h, dt = spring('leapfrog', 0.3), 0.3
    q, k = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    energies = lambda q, k: (formula(energy, k=k.item(), q=q.item(), dt=dt), (k.item() ** 2 + q.item() ** 2) / 2)
    e0, drift = energies(q, k), [0.0, 0.0]
    with torch.no_grad():
        for _ in range(200):
            q, k = h(q, k)
            drift = [max(d, abs(a - b)) for d, a, b in zip(drift, energies(q, k), e0)]
    assert drift[0] < 1e-12 and drift[1] > 1e-3
    # correction A: Euler's error at dt = 0.1 relative to |H0| = cos 1, its factors per halving, the slope
    euler, slope = halving['euler']
    worst = pendulum_energy_error('euler', 0.1)  # the script prints it to 2 digits: here, all of them
    assert f"{worst:.1e}" == f"{e['euler', 0.1]:.1e}"
    assert abs(number_in(r'energy error is (\d+)% of', answer) - 100 * worst / math.cos(1)) < 0.5
    assert number_in(r'`dt = 0.05` is ([\d.]+), not 2', answer) == euler[0] and euler[0] > 2.1
    reaches, a, b = re.search(r'reaches ([\d.]+) only at the halving from `dt = ([\d.]+)` to `dt = ([\d.]+)`',
                              answer).groups()
    assert float(reaches) == euler[-1] and (float(a), float(b)) == (0.1 / 2 ** 4, 0.1 / 2 ** 5)
    assert all(r > 2.05 for r in euler[:-1]) and euler[-1] < 2.05  # "only" there
    assert number_in(r'six step sizes, ([\d.]+),', answer) == slope
    assert number_in(r"factor is ([\d.]+) at every halving", answer) == halving['leapfrog'][0][0]
    # correction F: leapfrog's bound needs a small dt (unstable past 2 for the spring), a bounded orbit (V = -q^2/2:
    # the modified energy k^2/2 + c (1 - c dt^2/4) q^2/2 is kept, H is not); the model takes one step by default
    assert number_in(r'unstable once `dt >= (\d+)`', answer) == 2  # from dt = 2 on: there J is a Jordan block

    def worst_energy_error(h, steps=400):  # the spring's H = (k^2 + c q^2)/2
        return energy_error(h, lambda q, k: (k ** 2 + h.c * q ** 2) / 2, steps)
    assert worst_energy_error(spring('leapfrog', 1.9))[0] < 10 < 1e6 < worst_energy_error(spring('leapfrog', 2.1))[0]
    J = torch.tensor([[1 - 2.0 ** 2 / 2, 2.0], [-2.0 * (1 - 2.0 ** 2 / 4), 1 - 2.0 ** 2 / 2]])  # the step at dt = 2
    assert torch.linalg.matrix_power(J, 10).tolist() == [[1, -20], [0, 1]]  # a Jordan block: orbits grow linearly
    runaway, inverted = worst_energy_error(spring('leapfrog', 0.1, c=-1.0), 40), worst_energy_error(
        spring('leapfrog', 0.1, c=-1.0), 80)
    assert inverted[0] > 10 * runaway[0] and inverted[1] > 10 * runaway[1]  # grows with q^2 as the orbit runs away
    assert '`--qk_steps=1`' in answer and GPTConfig().qk_steps == 1
    # the long run: leapfrog bounded (the same bound at the end as at the start), Euler drifting
    assert long['leapfrog'][1] <= 1.01 * long['leapfrog'][0] and long['euler'][1] > 5 * long['euler'][0]


def test_lab_answer_2_volume_return_symplecticity_hold_their_formulas(lab):
    answer = lab_section(2, lab_text('ANSWERS.md'))
    rows = exercise_2_rows(lab_output(lab, 2))
    # leapfrog is the kick and the drift as written, kick-drift-kick: the same numbers as the model's step
    kick, drift = stated_formula(r'A kick `k \+= (.*?)`', answer), stated_formula(r'a drift `q \+= (.*?)`', answer)
    h = hamiltonian('leapfrog', nh=1)
    q, k = qk_pair(nh=1)
    dt = h.dt.view(-1, 1, 1)
    F = lambda q: h.force(q)  # noqa: E731
    k_ = k + formula(kick, dt=dt, F=F, q=q)
    q_ = q + formula(drift, dt=dt, k=k_)
    k_ = k_ + formula(kick, dt=dt, F=F, q=q_)
    q1, k1 = h(q, k)
    assert torch.allclose(q_, q1, atol=1e-12) and torch.allclose(k_, k1, atol=1e-12)
    # the kick's and the drift's Jacobians, as written (blocks of (q, k)), against autograd; the drift is always
    # symplectic, the kick exactly when dF/dq is symmetric (the potential's force: yes; the free force: no)
    kick_J = stated_formula(r'A kick `k \+= dt/2 F\(q\)` has the Jacobian `(.*?)`', answer)
    drift_J = stated_formula(r'a drift `q \+= dt k` has `(.*?)`', answer)
    n, dt = 4, 0.3
    I, Omega = torch.eye(n, dtype=torch.float64), torch.zeros(2 * n, 2 * n, dtype=torch.float64)
    Omega[:n, n:], Omega[n:, :n] = I, -I
    blocks = lambda text, G: torch.cat([torch.cat([b if torch.is_tensor(b) else b * I for b in row], 1) for row in  # noqa
                                       formula(text.replace('dF/dq', 'G'), I=I, dt=dt, G=G)], 0)
    x = torch.randn(2 * n, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    assert '`dF/dq = -Hess V`' in answer and 'The drift is always symplectic' in answer
    for force, symmetric in (('potential', True), ('mlp', False)):
        f = hamiltonian('leapfrog', nh=1, hs=n, force=force)
        force_of = lambda q: f.force(q.view(1, 1, n)).flatten()  # noqa: E731
        G = torch.autograd.functional.jacobian(force_of, x[:n])
        kick = torch.autograd.functional.jacobian(lambda x: torch.cat((x[:n], x[n:] + dt / 2 * force_of(x[:n]))), x)
        drift = torch.autograd.functional.jacobian(lambda x: torch.cat((x[:n] + dt * x[n:], x[n:])), x)
        assert torch.allclose(blocks(kick_J, G), kick, atol=1e-12) and torch.allclose(blocks(drift_J, G), drift)
        assert (drift.T @ Omega @ drift - Omega).abs().max() < 1e-12
        assert ((kick.T @ Omega @ kick - Omega).abs().max() < 1e-12) == symmetric == bool((G - G.T).abs().max() < 1e-12)
    # the return: sufficient, not necessary. Leapfrog is symplectic Euler of dt/2 (kick, drift), then its adjoint
    # (drift, kick); neither half is symmetric; a method composed with its adjoint is
    assert 'A sufficient condition is that each sub-step is itself symmetric' in answer and 'It is not necessary' in answer
    h = hamiltonian('leapfrog', nh=1)
    q, k = qk_pair(nh=1)
    dt = h.dt.view(-1, 1, 1)
    half = lambda q, k, dt: M.symplectic_euler(h, q, k, dt / 2)  # noqa: E731  kick, drift
    adjoint = lambda q, k, dt: (lambda q: (q, k + h.force(q, dt / 2)))(q + dt / 2 * k)  # noqa: E731  drift, kick
    assert torch.allclose(torch.cat(adjoint(*half(q, k, dt), dt)), torch.cat(h(q, k)), atol=1e-12)
    for part in (half, adjoint):
        assert not torch.allclose(torch.cat(part(*part(q, k, dt), -dt)), torch.cat((q, k)), atol=1e-3)
    # the adjoint of a method is the inverse of its step with -dt; composed with it, the method returns with -dt
    assert torch.allclose(torch.cat(half(*adjoint(q, k, dt), -dt)), torch.cat((q, k)), atol=1e-12)
    both = lambda q, k, dt: adjoint(*half(q, k, dt), dt)  # noqa: E731
    assert torch.allclose(torch.cat(both(*both(q, k, dt), -dt)), torch.cat((q, k)), atol=1e-12)
    # a symplectic Jacobian's singular values pair as s, 1/s (the stretch and squeeze printed); Euler's do not
    assert '`s`, `1/s`' in answer
    stretch, squeeze = re.search(r'a stretch by ([\d.]+) comes with a squeeze by ([\d.]+)', answer).groups()
    assert (float(stretch), float(squeeze)) == (rows['leapfrog', 'float64'][5], rows['leapfrog', 'float64'][4])
    assert abs(rows['leapfrog', 'float64'][4] * rows['leapfrog', 'float64'][5] - 1) < 0.01
    assert abs(rows['euler', 'float64'][4] * rows['euler', 'float64'][5] - 1) > 0.5
    # correction B: a palindrome of steps that are not exact sub-flows (two Euler steps of dt/2) does not return
    two_halves = hamiltonian('euler', steps=2, nh=1)
    assert not torch.allclose(two_halves(*two_halves(q, k), dt=-two_halves.dt)[0], q, atol=1e-3)
    # Euler's det J = det(I + dt^2 Hess V) (Hess V: the Hessian of V, a matrix; V below a unit)
    assert '`det J != 0`' in answer
    det = stated_formula(r"Euler's single step has `det J = (.*?)`", answer)
    h = hamiltonian('euler', hs=4, nh=1)
    x = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    hess = torch.autograd.functional.hessian(lambda q: h.f.V(q.view(1, 1, 1, 4)).sum(), x[:4])
    dt = h.dt.item()
    assert abs(jacobian_det(h, 4) - formula(det, det=torch.linalg.det, I=torch.eye(4, dtype=torch.float64), dt=dt,
                                            Hess=hess, V=1).item()) < 1e-10
    # undoing Euler means solving the stated equation: it holds at the step's start and end
    lhs, rhs = re.search(r'solving `(.*?) = (.*?)` for `q`', answer).groups()
    q1, k1 = h(q[..., :4], k[..., :4])
    assert torch.allclose(formula(lhs, q=q[..., :4], dt=h.dt.view(-1, 1, 1), F=h.force),
                          formula(rhs, q1=q1, k1=k1, dt=h.dt.view(-1, 1, 1)), atol=1e-12)
    # the quadratic potential: Euler's det J is the stated 1 + c dt^2, never 0 for c > 0, 0 at the stated dt for c < 0
    quadratic = stated_formula(r'the determinant is `(.*?)`', answer)
    vanishes = stated_formula(r'vanishes at `dt = (.*?)`', answer)
    for c, dt in ((2.0, 0.3), (2.0, 5.0), (-2.0, 0.3), (-2.0, formula(vanishes, c=-2.0))):
        h = spring('euler', dt, c=c)
        J = torch.autograd.functional.jacobian(lambda x: torch.cat(h(x[:1].view(1, 1, 1, 1), x[1:].view(
            1, 1, 1, 1)), -1).flatten(), torch.tensor([0.7, 0.2], dtype=torch.float64))
        assert abs(torch.linalg.det(J).item() - formula(quadratic, c=c, dt=dt)) < 1e-12
    assert abs(formula(quadratic, c=-2.0, dt=formula(vanishes, c=-2.0))) < 1e-12
    # the model's free force: its Jacobian is the stated A diag(silu'(W q + b)) W, not symmetric; ex2 shows how far off
    torch.manual_seed(0)
    mlp = FORCES['mlp'](1, 4, 6, w_std=1.0).double()
    with torch.no_grad():
        mlp.b.normal_()
    assert "`df/dq = A diag(silu'(W q + b)) W`" in answer
    x = torch.randn(4, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda q: mlp(q.view(1, 1, 4)).flatten(), x)
    A, W, b = mlp.a[0], mlp.W[0], mlp.b[0, 0]
    assert torch.allclose(J, A @ torch.diag(M.silu_grad(W @ x + b)) @ W, atol=1e-12) and (J - J.T).abs().max() > 0.1
    free = rows['free-force', 'float64']
    assert number_in(r'fails, by ([\d.e+]+) here', answer) == free[6] and free[6] > 1 and free[1] < 1e-12
    assert abs(free[2] - 1) < 1e-3 and abs(free[3] - 1) < 1e-3


def test_lab_answer_3_the_scores_hold_their_formulas(lab):
    answer = lab_section(3, lab_text('ANSWERS.md'))
    h = hamiltonian('leapfrog', nh=1)
    q, k = qk_pair(nh=1)
    q1_exact = stated_formula(r'exactly `q1 = (.*?)`', answer)
    k1_first = stated_formula(r'to first order, `k1 = (.*?)`', answer)
    scores = stated_formula(r'`q1_i \. k1_j = (.*?)` up to', answer)
    residual = {}
    for dt in (0.1, 0.05, 0.025):
        dt_ = torch.full((1,), dt, dtype=torch.float64)
        q1, k1 = h(q, k, dt=dt_)
        assert torch.allclose(q1, formula(q1_exact, q=q, k=k, dt=dt, F=h.force), atol=1e-12)  # exact
        F = lambda x: h.force(x.view(1, 1, -1)).flatten()  # noqa: E731  a token's force
        first = torch.tensor([[formula(scores, q_i=q[0, 0, a], k_j=k[0, 0, b], k_i=k[0, 0, a], q_j=q[0, 0, b], dt=dt,
                                       F=F).item() for b in range(q.size(2))] for a in range(q.size(2))])  # (T, T)
        residual[dt] = ((q1[0, 0] @ k1[0, 0].T - first.double()).abs().max().item(),
                        (k1 - formula(k1_first, k=k, dt=dt, F=h.force, q=q)).abs().max().item())
    for a, b in ((0.1, 0.05), (0.05, 0.025)):  # both second order: a quarter per halving
        assert all(3.3 < x / y < 4.7 for x, y in zip(residual[a], residual[b])), residual
    rows, _ = exercise_3_rows(lab_output(lab, 3))
    percent, at = re.search(r'`O\(dt\^2\)`: (\d+)% of the change at `dt = ([\d.]+)`', answer).groups()
    row = next(row for row in rows if row[0] == float(at))
    assert abs(100 * row[3] / row[1] - int(percent)) < 0.5


def silu_derivatives(z, n=3):  # silu', silu'', silu''' at z, by autograd
    z = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    out, y = [], F.silu(z)
    for _ in range(n):
        (y,) = torch.autograd.grad(y, z, create_graph=True)
        out.append(y.item())
    return out


def test_lab_answer_4_the_linear_regime_holds_its_series_and_growth_laws(lab):
    answer = lab_section(4, lab_text('ANSWERS.md'))
    rows, slopes = exercise_4_rows(lab_output(lab, 4))
    series = stated_formula(r"`silu'\(z\) = (.*?) \+ \.\.\.`", answer)
    for z in (0.01, -0.02):
        assert abs(formula(series, z=z) - silu_derivatives(z, 1)[0]) < 1e-7
    assert '`--qk_scale` sets the spread by scaling `W`, with `q`, `a`' in answer
    maps = []
    for scale in (1.0, 2.0):
        torch.manual_seed(0)
        maps.append(GPT(GPTConfig(n_layer=1, n_head=4, n_embd=128, vocab_size=257, block_size=128, attn='coupled',
                                  qk_scale=scale), verbose=False).transformer.h[0].attn.qk)
    assert torch.equal(maps[1].f.W, 2 * maps[0].f.W) and torch.equal(maps[1].f.a, maps[0].f.a)
    assert torch.equal(maps[1].dt, maps[0].dt)
    growth = [g for _, _, g in rows[0.0][1:]]
    power, factor = map(int, re.search(r'grows like `spread\^(\d)`, (\d+)x per doubling', answer).groups())
    assert factor == 2 ** power and abs(growth[0] / factor - 1) < 0.05 and abs(slopes[0.0] - power) < 0.1
    assert growth == sorted(growth, reverse=True) and growth[-1] < factor / 4  # slowing as SiLU bends away
    # correction C: with b != 0, silu'(b + z) has the stated z^2 term, silu'''(b) z^2/2 (silu''' vanishes only at 0)
    term = stated_formula(r'has a `z\^2` term, `(.*?)`', answer)
    for b in (0.0, 0.5):
        third = silu_derivatives(b)[2]
        for z in (1e-3, 2e-3):  # silu'(b + z) - silu'(b) - silu''(b) z: the z^2 term and o(z^2)
            d1, d2, _ = silu_derivatives(b)
            rest = silu_derivatives(b + z, 1)[0] - d1 - d2 * z
            assert abs(rest - formula(term.replace("silu'''(b)", 'third'), third=third, z=z)) < 1e-8
    assert abs(silu_derivatives(0.0)[2]) < 1e-12 and abs(silu_derivatives(0.5)[2]) > 0.05
    power, factor = map(int, re.search(r'grows like `spread\^(\d)`, (\d+)x per doubling\. The script', answer).groups())
    biased = [g for _, _, g in rows[0.5][1:]]
    assert factor == 2 ** power and abs(biased[0] / factor - 1) < 0.05 and abs(slopes[0.5] - power) < 0.1
    assert number_in(r'shows ([\d.]+)x at the smallest', answer) == biased[0]


def test_lab_answer_5_the_learned_model_holds_its_numbers_and_formulas(lab):
    answer = lab_section(5, lab_text('ANSWERS.md'))
    # the diagonal gains the stated term (with the force term and O(dt^2) the whole change): second order left over
    gain = stated_formula(r'the diagonal gains `(.*?)` from the first term', answer)
    h = hamiltonian('leapfrog', nh=1)
    q, k = qk_pair(nh=1)
    left = []
    for dt in (0.02, 0.01):
        q1, k1 = h(q, k, dt=torch.full((1,), dt, dtype=torch.float64))
        for i in range(q.size(2)):
            q_i, k_i = q[0, 0, i], k[0, 0, i]
            change = q1[0, 0, i] @ k1[0, 0, i] - q_i @ k_i
            force = dt * q_i @ h.force(q_i.view(1, 1, -1)).flatten()
            left.append((dt, i, (change - force - formula(gain, dt=dt, k_i=k_i)).abs().item()))
    total = lambda dt: sum(e for at, _, e in left if at == dt)  # noqa: E731  over the tokens
    assert 3.3 < total(0.02) / total(0.01) < 4.7
    # the score of (i, j) gains the stated first-order term: second order left over, every pair
    score_gain = stated_formula(r'To first order the score of `\(i, j\)` gains `(.*?)`', answer)
    F_ = lambda x: h.force(x.view(1, 1, -1)).flatten()  # noqa: E731  a token's force
    q, k = qk_pair(nh=1)
    left = []
    for dt in (0.02, 0.01):
        q1, k1 = h(q, k, dt=torch.full((1,), dt, dtype=torch.float64))
        stated_gain = torch.tensor([[formula(score_gain, dt=dt, q_i=q[0, 0, a], k_i=k[0, 0, a], k_j=k[0, 0, b], F=F_,
                                             q_j=q[0, 0, b]).item() for b in range(5)] for a in range(5)])
        left.append((q1[0, 0] @ k1[0, 0].T - q[0, 0] @ k[0, 0].T - stated_gain.double()).abs().max().item())
    assert 3.3 < left[0] / left[1] < 4.7
    # attention's first-order change: the stated Delta p_ij against the softmax, for a small change of the scores
    change = stated_formula(r'to first order `Delta p_ij = (.*?)`', answer).replace('Delta ', 'Delta_')
    change = re.sub(r'sum_l (\w+)_il (\w+)_il', r'(\1 * \2).sum(-1, keepdim=True)', change)
    g = torch.Generator().manual_seed(4)
    d, S, dS = 16, 3 * torch.randn(6, 6, dtype=torch.float64, generator=g), torch.randn(6, 6, dtype=torch.float64,
                                                                                        generator=g)
    P = (S / math.sqrt(d)).softmax(-1)
    left = []
    for eps in (1e-3, 5e-4):
        stated_change = formula(change, p_ij=P, p=P, Delta_s_ij=eps * dS, Delta_s=eps * dS, d=d, sqrt=math.sqrt)
        left.append(((((S + eps * dS) / math.sqrt(d)).softmax(-1) - P) - stated_change).abs().max().item())
    assert 3.3 < left[0] / left[1] < 4.7
    # the diagonal's dt |k_i|^2 beats dt k_i . k_j exactly where the stated signed projection exceeds |k_i|
    projection = stated_formula(r'the signed projection of `k_j` on `k_i`, `(.*?)`, exceeds `\|k_i\|`', answer)
    keys = torch.randn(30, 4, dtype=torch.float64, generator=g)
    for i, j in itertools.product(range(6), range(30)):
        k_i, k_j = keys[i], keys[j]
        assert bool(0.1 * k_i @ k_j > 0.1 * k_i @ k_i) == bool(formula(projection, k_i=k_i, k_j=k_j) > k_i.norm())
    # correction D: the numbers, from the lab's copy of a quick-start run: the diagonal's score, its attention
    _, heads = exercise_5_rows(lab_output(lab, 5))
    rises, of = map(int, re.search(r'it rises in (\d+) of the (\d+) rows of every head', answer).groups())
    assert of == 48 and all(h[5] == rises for h in heads)
    falls = tuple(map(float, re.search(r'Its attention falls in (\d+) to (\d+) of the 48 rows', answer).groups()))
    assert falls == (min(h[6] for h in heads), max(h[6] for h in heads))
    leads = tuple(map(float, re.search(r'largest attention gain in (\d+) to (\d+) rows', answer).groups()))
    assert leads == (min(h[8] for h in heads), max(h[8] for h in heads)) and leads[0] > 24  # half or more
    rows = re.search(r'largest score gain in only (\d+) to (\d+) of the (\d+) rows', answer).groups()
    assert tuple(map(float, rows)) == (min(h[7] for h in heads), max(h[7] for h in heads), 48) and float(rows[1]) < 24
    alone, first = re.search(r'explains R\^2 of ([\d.]+ to [\d.]+) of the score changes, and the whole first-order '
                             r'formula ([\d.]+ to [\d.]+)', answer).groups()
    for stated_range, column in ((alone, 3), (first, 4)):
        low, high = map(float, stated_range.split(' to '))
        assert (low, high) == (min(h[column] for h in heads), max(h[column] for h in heads))
    # correction E: a shift of k drops out of the softmax with learned positions, not with rope; one of q never does;
    # the diagnostic's affine fit calls a shift of q linear
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 2, 8, 16).unbind(0)
    c = torch.randn(16)
    attention = lambda q, k: (q @ k.transpose(-1, -2)).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(),
                                                                   float('-inf')).softmax(-1)
    rope = M.Rotary(16, 8)
    assert (attention(q, k + c) - attention(q, k)).abs().max() < 1e-6
    assert (attention(rope(q, 0), rope(k + c, 0)) - attention(rope(q, 0), rope(k, 0))).abs().max() > 1e-2
    assert (attention(q + c, k) - attention(q, k)).abs().max() > 1e-2

    class Shift(nn.Module):  # q + c: what c_attn, with no bias, cannot do
        def forward(self, q, k):
            return q + 1.0, k
    model = build('coupled')
    for blk in model.transformer.h:
        blk.attn.qk = Shift()
    assert all(s['nonlinear'] < 1e-6 for s in qk_diagnostics(model, idx_batch(B=16)))
    assert model.config.bias is False and 'is therefore a lower bound' in answer


def stub(repo, end='final', code=0, wait=0, ckpt=True, tokens=128):
    """A stub train.py (a run: its folder, a checkpoint unless not ckpt, a log that starts and ends with `end`; its
    calls counted, its exit code `code`, after `wait` seconds) and an empty bench.py."""
    open(repo / 'train.py', 'w').write(
        "import json, os, sys, time\nout = [a for a in sys.argv if a.startswith('--out_dir=')][0][10:]\n"
        f"os.makedirs(out, exist_ok=True); {ckpt} and open(os.path.join(out, 'ckpt.pt'), 'w').close()\n"
        "open('calls', 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"time.sleep({wait})\n"
        "with open(os.path.join(out, 'metrics.jsonl'), 'a') as f:\n"
        f"    f.write('{{\"event\": \"start\"}}\\n{{\"event\": \"{end}\", \"tokens\": {tokens}}}\\n')\n"
        f"print('error: the loss is not finite at iteration 3; stopped' if {code} == 3 else 'ok')\n"
        f"sys.exit({code})\n")
    open(repo / 'bench.py', 'w').write('')


def test_lab_exercise_6_launcher_retrains_what_changed_and_leaves_a_running_run_alone(tmp_path):
    """ex6_train.py with stub train.py and bench.py (a run is a ckpt.pt): a run is kept only while its step, what the
    step calls in model.py, and train.py's flags are the same; a folder a train.py holds is never deleted."""
    import fcntl
    repo = tmp_path / 'repo'
    os.makedirs(repo / 'exercises')
    shutil.copy(os.path.join(LAB, 'ex6_train.py'), repo / 'exercises')
    stub(repo)
    helper = "\nHALF = 0.5\n\n\ndef half_kick(h, q, k, dt):\n    return k + h.force(q, HALF * dt)\n"
    template = lab_text('ex6_mine.py').replace('k = k + h.force(q, dt / 2)', 'k = half_kick(h, q, k, dt)')
    assert template.count('half_kick') == 2
    write = lambda text: open(repo / 'model.py', 'w').write(  # noqa: E731
        open(os.path.join(HERE, 'model.py')).read() + helper + text)
    launch = lambda *flags: run(repo / 'exercises' / 'ex6_train.py', 'mine', '--seeds', '1', '--', *flags,  # noqa
                                cwd=repo).stdout
    write(template)
    assert 'runs/mine/mine-s1: done' in launch()
    assert 'holds a run of this step and these flags already, kept' in launch()
    assert 'its flags changed since, trained again: done' in launch('--learning_rate=1e-2')
    write(template.replace('return q, k', 'return q, k  # edited'))  # the step itself
    assert 'its step changed since, trained again: done' in launch('--learning_rate=1e-2')
    helper = helper.replace('HALF * dt', 'HALF * dt * 1.0')  # a function the step calls
    write(template)
    assert 'its step changed since, trained again: done' in launch('--learning_rate=1e-2')
    helper = helper.replace('HALF = 0.5', 'HALF = 0.25')  # a constant that function reads
    write(template)
    assert 'its step changed since, trained again: done' in launch('--learning_rate=1e-2')
    assert 'kept' in launch('--learning_rate=1e-2')
    calls = open(repo / 'calls').read().splitlines()
    assert len(calls) == 5 and all('--attn=mine' in c for c in calls)
    # a run a train.py is writing: its folder locked (train.py flocks it) and train.lock naming it; never deleted
    folder = repo / 'runs' / 'mine' / 'mine-s1'
    open(folder / 'train.lock', 'w').write('pid 4242, started now')
    os.remove(folder / 'step.txt')  # as a run still training has no record yet
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = launch('--learning_rate=1e-2')
    finally:
        os.close(fd)
    assert 'mine-s1: in use by a running train.py (pid 4242, started now); left alone' in out, out
    assert (folder / 'ckpt.pt').exists() and len(open(repo / 'calls').read().splitlines()) == 5
    # a run that fails: its error line on the console, not only in its log
    open(repo / 'train.py', 'w').write("print('step 0: loss 5.5')\nprint('error: no data in data; run prepare')\n"
                                       "print('a last line')\nraise SystemExit(1)\n")
    out = launch('--learning_rate=1e-3')
    assert 'mine-s1: its step and flags are not recorded, trained again: failed (exit 1): error: no data in data;' \
        in out and '(all of its output: runs/mine/mine-s1.new.log; the run the folder held' in out, out
    assert (folder / 'ckpt.pt').exists() and not (folder.parent / 'mine-s1.new').exists()  # the stale run stays
    stub(repo)  # after --, all is train.py's: no variant named trains the default three
    r = run(repo / 'exercises' / 'ex6_train.py', '--seeds', '1', '--', '--learning_rate=1e-3', cwd=repo)
    assert r.returncode == 0 and 'training 3 runs, 2 at a time: mine-s1, coupled-s1, standard-s1' in r.stdout, r


def ended(folder):  # how the run's log ends, as the launcher reads it
    events = [json.loads(line)['event'] for line in open(folder / 'metrics.jsonl')]
    return [e for e in events if e in ('start', 'final', 'diverged')][-1]


def test_lab_exercise_6_launcher_resumes_a_run_cut_short_counts_failures_and_stops_on_ctrl_c(tmp_path):
    """ex6_train.py with stub runs: an interrupted run is resumed, a diverged one is a result (kept, not retrained,
    not a failure), a failed one makes the launcher exit 1 after the table, a repeated seed is trained once, and
    Ctrl-C stops it with one line and exit 130, starting no run after it."""
    repo = tmp_path / 'repo'
    os.makedirs(repo / 'exercises')
    shutil.copy(os.path.join(LAB, 'ex6_train.py'), repo / 'exercises')
    shutil.copy(os.path.join(HERE, 'model.py'), repo)
    launch = lambda *seeds: run(repo / 'exercises' / 'ex6_train.py', 'coupled', '--seeds', *seeds, cwd=repo)  # noqa
    calls = lambda: open(repo / 'calls').read().splitlines()  # noqa: E731
    stub(repo, end='start', code=130)  # Ctrl-C: a checkpoint, no final
    r = launch('1')
    assert r.returncode == 1 and 'coupled-s1: interrupted; run the same command again to resume it' in r.stdout
    stub(repo)
    r = launch('1')
    assert 'coupled-s1: interrupted before, resumed: done' in r.stdout and '--init_from=resume' in calls()[-1]
    assert 'already, kept' in launch('1').stdout and len(calls()) == 2
    stub(repo, end='diverged', code=3)
    r = launch('2', '2')
    assert 'note: a repeated --attn or seed is trained once' in r.stdout and len(calls()) == 3
    assert r.returncode == 0 and 'coupled-s2: diverged: the loss is not finite at iteration 3' in r.stdout, r.stdout
    assert 'already (it diverged), kept' in launch('2').stdout and len(calls()) == 3
    folder = repo / 'runs' / 'mine' / 'coupled-s2'  # a retraining that ended, its rename to the run cut short
    os.rename(folder, f'{folder}.new')
    assert 'already (it diverged), kept' in launch('2').stdout and folder.is_dir() and len(calls()) == 3
    stub(repo, end='diverged', code=3, ckpt=False)  # diverged before its first checkpoint: a result all the same
    assert 'coupled-s8: diverged' in launch('8').stdout and 'already (it diverged), kept' in launch('8').stdout
    (repo / 'runs' / 'mine' / 'coupled-s8' / 'step.txt').write_bytes(b'\xff\xfe x\x00')  # not even text
    assert 'coupled-s8: its step and flags are not recorded, trained again: diverged' in launch('8').stdout
    stub(repo, end='start', code=1)
    r = launch('3', '4')
    assert r.returncode == 1 and r.stderr.strip() == 'error: 2 of 2 runs did not finish (their lines above say ' \
        'why)', r
    # what names a run is the launcher's; a --runs that cannot be a folder; a second launcher on the same runs
    r = run(repo / 'exercises' / 'ex6_train.py', 'coupled', '--', '--seed=7', cwd=repo)
    assert one_line_error(r, '--seed after -- would train another run than its folder names'), r
    (repo / 'afile').write_text('')
    r = run(repo / 'exercises' / 'ex6_train.py', 'coupled', '--runs', 'afile/x', cwd=repo)
    assert one_line_error(r, '--runs=afile/x: cannot make or open that folder (Not a directory); name another'), r
    import fcntl
    fd = os.open(repo / 'runs' / 'mine', os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = launch('1')
    finally:
        os.close(fd)
    assert one_line_error(r, 'another exercises/ex6_train.py is training into runs/mine; wait for it'), r
    stub(repo, end='start')  # a train.py that stops at once and exits 0, as `-- --help` makes it: no run
    r = run(repo / 'exercises' / 'ex6_train.py', 'coupled', '--seeds', '1', '--', '--help', cwd=repo)
    assert r.returncode == 1 and 'coupled-s1: its flags changed since, trained again: failed (exit 0): train.py ' \
        'ended without training a run (its last line: ok)' in r.stdout, r
    assert ended(repo / 'runs' / 'mine' / 'coupled-s1') == 'final'  # the finished run stays
    stub(repo, tokens=0)  # a final of no training, as `-- --max_iters=0` makes: no run either
    r = run(repo / 'exercises' / 'ex6_train.py', 'coupled', '--seeds', '1', '--', '--max_iters=0', cwd=repo)
    assert r.returncode == 1 and 'failed (exit 0): train.py ended without training a run' in r.stdout, r
    assert ended(repo / 'runs' / 'mine' / 'coupled-s1') == 'final'
    stub(repo)  # a stale run that is a link to a folder elsewhere: the link goes, the folder it names stays
    shutil.copytree(repo / 'runs' / 'mine' / 'coupled-s1', tmp_path / 'kept')
    os.symlink(tmp_path / 'kept', repo / 'runs' / 'mine' / 'coupled-s10')
    r = run(repo / 'exercises' / 'ex6_train.py', 'coupled', '--seeds', '10', '--', '--max_iters=3', cwd=repo)
    assert 'coupled-s10: its flags changed since, trained again: done' in r.stdout, r
    assert not (repo / 'runs' / 'mine' / 'coupled-s10').is_symlink() and (tmp_path / 'kept' / 'ckpt.pt').exists()
    os.makedirs(tmp_path / 'elsewhere')  # a leftover retraining that is a link: the link goes, not what it names
    os.symlink(tmp_path / 'elsewhere', repo / 'runs' / 'mine' / 'coupled-s2.new')
    r = launch('2')
    assert r.returncode == 0 and 'coupled-s2: holds a run of this step and these flags already (it diverged), kept' \
        in r.stdout, r
    assert not os.path.lexists(repo / 'runs' / 'mine' / 'coupled-s2.new') and (tmp_path / 'elsewhere').is_dir()
    os.makedirs(repo / 'runs' / 'mine' / 'coupled-s11.log')  # a folder where a run's output goes
    r = launch('11')
    assert r.returncode == 1 and "coupled-s11.log: cannot write the run's output there (Is a directory)" in r.stdout
    (repo / 'runs' / 'mine' / 'coupled-s9').write_text('')  # a file where a run's folder goes
    r = launch('9')
    assert r.returncode == 1 and "runs/mine/coupled-s9: cannot make the run's folder there (File exists); move " \
        "what is in the way" in r.stdout, r
    stub(repo, wait=3)  # Ctrl-C while the first of two runs (one at a time) trains
    p = start(repo / 'exercises' / 'ex6_train.py', 'coupled', '--seeds', '5', '6', '--jobs', '1', cwd=repo,
              sigint_ignored=True)  # as a shell's background job inherits it
    while len(calls()) < 11:
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip().endswith('Ctrl-C: stopped; run the same command again to resume the '
                                                        'runs cut short'), (out, err)
    assert len(calls()) == 11 and not (repo / 'runs' / 'mine' / 'coupled-s6').exists()


def test_lab_exercise_6_the_template_passes_its_claims_trains_and_the_launcher_tabulates(lab, monkeypatch):
    # the template as if appended to model.py: its claims checked as `pytest -k mine` checks them
    assert 'mine' not in INTEGRATORS and 'mine' not in QK_TRANSFORMS  # a new name: a built-in's is refused
    try:
        exec(lab_text('ex6_mine.py'), dict(vars(M)))
        for claim in CLAIMS:
            T.test_each_entry_keeps_what_it_promises('mine', claim)
            if claim != 'identity_at_zero':
                T.test_each_integrator_keeps_what_it_promises_under_the_potential('mine', claim)
        ratio, _ = measure(lambda steps: entry_map('mine', steps), 'order')
        assert 3.5 < ratio < 4.5  # order 2, as leapfrog's
        for steps in (1, 3):
            counted, priced = counted_and_priced_matmul_flops('mine', steps)
            assert counted == priced > 0
            T.test_every_entrys_elementwise_price_is_what_is_counted('mine', steps)
        test_lab_each_integrators_declared_cost_is_what_its_step_does('mine')  # exact: 4 is not 5
    finally:
        INTEGRATORS.pop('mine', None), QK_TRANSFORMS.pop('mine', None)
    # exercise 2 takes it as an argument (as exercise 1 does): its row is leapfrog's
    rows = exercise_2_rows(lab_output(lab, 2))
    assert rows['mine', 'float64'] == rows['leapfrog', 'float64']
    # the launcher: the runs, then bench.py's table of them
    out, error, repo, again = lab['launcher']
    assert error.endswith('(exit 0)'), error[-2000:]
    assert 'training 1 run, 1 at a time' in out and '| pydocs | mine | 1 |' in out  # then bench.py's table
    runs = repo / 'runs' / 'mine'
    assert (runs / 'mine-s1' / 'ckpt.pt').exists() and (runs / 'mine-s1.log').exists()
    # run again: kept while `mine` is the same (the hash of its source and the flags, step.txt)
    assert all(r.returncode == 0 for r in again), [r.stderr[-2000:] for r in again]
    assert 'runs/mine/mine-s1: holds a run of this step and these flags already, kept' in again[0].stdout, \
        again[0].stdout
    assert 'def mine(h, q, k, dt):' in open(runs / 'mine-s1' / 'step.txt').read()  # the step's source, recorded
    # the answer's claims about the steps students pick: drift-kick-drift, Runge-Kutta
    answer = lab_section(6, lab_text('ANSWERS.md'))

    def dkd(h, q, k, dt):
        q = q + dt / 2 * k
        k = k + h.force(q, dt)
        return q + dt / 2 * k, k

    assert 'Drift-kick-drift is symplectic, symmetric and of order 2, with one force a step' in answer
    assert 'Runge-Kutta step is of order 4 but neither symplectic nor symmetric' in answer
    percent = re.search(r"at `dt = 0.1` Euler's scores differ from leapfrog's by (\d+)% of their change", answer)
    assert percent and f"`O(dt^2)`: {percent.group(1)}% of the change at `dt = 0.1`" in lab_section(
        3, lab_text('ANSWERS.md')) and 'one seed' in answer
    ops = int(number_in(r'with one force a step and (\d) vector operations', answer))  # "one force": 1
    monkeypatch.setitem(M.INTEGRATORS, 'dkd', Integrator(dkd, symplectic=True, volume_preserving=True, symmetric=True,
                                                         order=2, forces=1, vector_ops=ops))
    for what in CLAIMS[:-1]:
        T.test_each_integrator_keeps_what_it_promises_under_the_potential('dkd', what)
    test_lab_each_integrators_declared_cost_is_what_its_step_does('dkd')  # the answer's 1 and 5, counted
    assert counted_cost(dkd) == counted_cost(lab_step('dkd'))  # the worksheet's reference is the same step
    # Runge-Kutta: its state's error falls 2^4 per halving of dt, so the order test (which measures the state's) takes
    # a claim of 4; its energy's error on exercise 1's pendulum falls the stated factor, faster
    falls, claim = re.search(r'measures the state.s error, which falls about (\d+)x per halving of `dt`, so a claim '
                             r'of order (\d) passes', answer).groups()
    monkeypatch.setitem(M.INTEGRATORS, 'rk4', Integrator(rk4, symplectic=False, volume_preserving=False,
                                                         symmetric=False, order=int(claim), forces=4, vector_ops=26))
    for what in CLAIMS[:-1]:
        T.test_each_integrator_keeps_what_it_promises_under_the_potential('rk4', what)
    ratio, _ = measure(lambda steps: one_head(Hamiltonian(1, 4, 8, steps, 'rk4')), 'order')
    assert abs(ratio / int(falls) - 1) < 0.1 and int(falls) == 2 ** int(claim)
    state = []
    for dt in (0.1, 0.05, 0.00625):  # the pendulum's state at time 2
        h = Pendulum(1, 1, 1, round(2 / dt), 'rk4', dt=dt).double()
        with torch.no_grad():
            h.dt.fill_(dt)
        state.append(torch.cat(h(torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1,
                                                                                              dtype=torch.float64))))
    assert 14 < (state[0] - state[2]).norm() / (state[1] - state[2]).norm() < 18  # 2^4
    factor = number_in(r'its energy error on the pendulum falls about (\d+)x per halving', answer)
    energy = pendulum_energy_error('rk4', 0.1) / pendulum_energy_error('rk4', 0.05)
    assert abs(energy / factor - 1) < 0.05 and energy > 1.4 * 2 ** 4  # faster than the order says
    calls = []

    class Counted(Hamiltonian):
        def force(self, q, scale=1.0):
            calls.append(1)
            return super().force(q, scale)
    hamiltonian('dkd', 3, cls=Counted)(*qk_pair())
    assert len(calls) == 3  # one force a step


def rk4(h, q, k, dt):  # the classical fourth-order Runge-Kutta step of q' = k, k' = F(q): 4 forces, 26 vector ops
    k1q, k1k = k, h.force(q)
    k2q, k2k = k + dt / 2 * k1k, h.force(q + dt / 2 * k1q)
    k3q, k3k = k + dt / 2 * k2k, h.force(q + dt / 2 * k2q)
    k4q, k4k = k + dt * k3k, h.force(q + dt * k3q)
    return q + dt / 6 * (k1q + 2 * k2q + 2 * k3q + k4q), k + dt / 6 * (k1k + 2 * k2k + 2 * k3k + k4k)


def lab_step(name):  # the lab's reference steps, by the worksheet's hint card's names
    if name == 'dkd':
        scope = {}
        exec(DKD_STEP, scope)
        return scope['dkd']
    return {'leapfrog': M.leapfrog, 'yoshida': yoshida, 'rk4': rk4}[name]


def counted_cost(step, nh=2, hs=8):
    """(forces, vector ops) of one step(h, q, k, dt), counted exactly: the calls of h.force, and the pointwise ops
    (Elementwise's convention) on (q, k)-sized numbers outside the force, per token and head. The force is free here
    (zeros, made by no pointwise op), and ops on dt alone, nh numbers, drop out of the difference of two sizes."""
    calls = []

    class Free(Hamiltonian):
        def force(self, q, scale=1.0):
            calls.append(1)
            return torch.zeros_like(q)
    h = Free(nh, hs, 4, 1)

    def count(N):
        q, k = torch.randn(2, nh, N, hs).unbind(0)
        with Elementwise() as c:
            out = step(h, q, k, torch.full((nh, 1, 1), 0.1))
        assert len(out) == 2
        return c.flops
    ops = (count(7) - count(3)) / (4 * nh * hs)
    forces = len(calls) // 2
    assert ops == int(ops) and len(calls) == 2 * forces, (ops, len(calls))
    return forces, int(ops)


@pytest.mark.parametrize('name', INTEGRATORS)
def test_lab_each_integrators_declared_cost_is_what_its_step_does(name):
    # exercise 6's cost check, exact: an Integrator's forces and vector_ops are what one step calls and writes (with
    # `mine` appended to model.py, `pytest -k mine` runs it for yours); the FLOP price is read off these two numbers
    it = INTEGRATORS[name]
    forces, ops = counted_cost(it.step)
    assert (it.forces, it.vector_ops) == (forces, ops), (
        f"{name} declares forces={it.forces}, vector_ops={it.vector_ops}; one step calls h.force {forces} times and "
        f"does {ops} elementwise ops on (q, k)-sized vectors")


def test_lab_exercise_6_the_hint_card_states_each_steps_counted_cost():
    # the worksheet's hint card: each candidate's forces and vector operations, as the tests' reference steps count
    card = lab_section(6, lab_text('WORKSHEET.md')).split('**Hint card')[1].split('**Run**')[0]
    rows = {name: (int(forces), int(ops)) for name, forces, ops in
            re.findall(r'\| ([^|]+?) \| [^|]+ \| (\d+) \| (\d+) \|', card)}
    names = {'`leapfrog` (the template)': 'leapfrog', 'drift-kick-drift': 'dkd', "Yoshida's fourth order": 'yoshida',
             'classical Runge-Kutta': 'rk4'}
    assert set(rows) == set(names), rows
    for text, name in names.items():
        assert rows[text] == counted_cost(lab_step(name)), name
    assert rows['`leapfrog` (the template)'] == (INTEGRATORS['leapfrog'].forces, INTEGRATORS['leapfrog'].vector_ops)
    # a drift-kick-drift declared with 4 vector ops, as the issue tried, fails the exact check
    wrong = Integrator(lab_step('dkd'), True, True, True, order=2, forces=1, vector_ops=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(INTEGRATORS, 'dkd-miscounted', wrong)
        with pytest.raises(AssertionError, match='declares forces=1, vector_ops=4; one step calls h.force 1 times '
                                                 'and does 5'):
            test_lab_each_integrators_declared_cost_is_what_its_step_does('dkd-miscounted')


def free_force(hs, m, spread, seed=0, A=None):  # FORCES['mlp'] at init, W of std `spread` (A then scales with it)
    torch.manual_seed(seed)
    f = FORCES['mlp'](1, hs, m, w_std=spread).double()
    if A is not None:
        with torch.no_grad():
            f.a.copy_(A(f))
    return f


def nonlinear_part(f, hs):  # |f - its best affine fit| over 400 fixed q of unit entries: what W_q, W_k cannot absorb
    q = torch.randn(1, 400, hs, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = f(q)[0]
    x1 = torch.cat((q[0], torch.ones(400, 1, dtype=torch.float64)), -1)
    return (y - x1 @ torch.linalg.lstsq(x1, y).solution).norm().item()


def test_lab_the_glossarys_silu_and_free_force_statements_hold():
    # the README's Glossary (SiLU, the free force): silu has a z^2/4 term, silu' none, so at b = 0 the free force
    # A silu(W q) has a quadratic part, A (W q)^2/4, which grows as spread^3 (A scales with W at init), while the
    # potential's force -W^T (a silu'(W q)) is affine up to a cubic, spread^4
    for z in (1e-2, 5e-3):
        silu, grad = F.silu(torch.tensor(z, dtype=torch.float64)).item(), silu_derivatives(z, 1)[0]
        assert abs((silu - z / 2) / z ** 2 - 1 / 4) < 0.01  # silu(z) = z/2 + z^2/4 + O(z^4)
        assert abs((grad - 1 / 2 - z / 2) / z ** 2) < 0.01 and abs((grad - 1 / 2 - z / 2) / z ** 3 + 1 / 12) < 0.01
    # measured: the free force's nonlinear part grows 8x per doubling of the spread, the potential's force's 16x
    hs, m = 4, 8
    spreads = (1 / 64, 1 / 32, 1 / 16)
    assert torch.equal(free_force(hs, m, 0.5).a, 0.5 * free_force(hs, m, 1.0).a)  # A scales with W at init
    free = [nonlinear_part(free_force(hs, m, s), hs) for s in spreads]
    potential = []
    for s in spreads:
        torch.manual_seed(0)
        potential.append(nonlinear_part(FORCES['potential'](1, hs, m, w_std=s).double(), hs))
    for a, b in zip(free, free[1:]):
        assert abs(b / a / 8 - 1) < 0.05, free  # spread^3
    for a, b in zip(potential, potential[1:]):
        assert abs(b / a / 16 - 1) < 0.05, potential  # spread^4
    # A = W^T diag(c) makes the free force a gradient: its Jacobian W^T diag(c silu'(W q + b)) W is symmetric, and
    # leapfrog under it is symplectic; a generic A gives neither
    c = torch.randn(m, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    Omega = torch.zeros(2 * hs, 2 * hs, dtype=torch.float64)
    Omega[:hs, hs:], Omega[hs:, :hs] = torch.eye(hs), -torch.eye(hs)
    x = torch.randn(2 * hs, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    gaps = []
    for A in (lambda f: (f.W[0].T @ torch.diag(c))[None], None):
        f = free_force(hs, m, 1.0, A=A)
        with torch.no_grad():
            f.b.normal_()
        dF = torch.autograd.functional.jacobian(lambda q: f(q.view(1, 1, hs)).flatten(), x[:hs])
        h = Hamiltonian(1, hs, m, 2, 'leapfrog', dt=0.7, force='mlp').double()
        h.f = f
        J = torch.autograd.functional.jacobian(lambda x: torch.cat(h(x[:hs].view(1, 1, 1, hs), x[hs:].view(
            1, 1, 1, hs)), -1).flatten(), x)
        gaps.append(((dF - dF.T).abs().max().item(), (J.T @ Omega @ J - Omega).abs().max().item()))
    (sym, symplectic), (generic_sym, generic_symplectic) = gaps
    assert sym < 1e-12 and symplectic < 1e-12 and generic_sym > 0.1 and generic_symplectic > 0.1, gaps


def test_lab_scripts_refuse_bad_input_in_one_line(tmp_path):
    # bad arguments and unfit runs: one line naming what to do, never a traceback
    def checkpoint(folder, **changes):
        config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=257, block_size=64, attn='coupled')
        config = dataclasses.replace(config, **changes)
        os.makedirs(tmp_path / folder)
        torch.save(dict(model_args=dataclasses.asdict(config), model=GPT(config, verbose=False).state_dict(),
                        config=dict(dataset='pydocs'), iter_num=0), tmp_path / folder / 'ckpt.pt')
    checkpoint('standard', attn='standard')
    checkpoint('short', block_size=32)
    os.makedirs(tmp_path / 'truncated')
    with open(os.path.join(LAB, 'quickstart', 'ckpt.pt'), 'rb') as f, open(tmp_path / 'truncated' / 'ckpt.pt', 'wb') as g:
        g.write(f.read(100_000))
    os.makedirs(tmp_path / 'noval')
    shutil.copy(os.path.join(LAB, 'quickstart', 'ckpt.pt'), tmp_path / 'noval')  # no val.bin beside it, no data/
    ex5 = os.path.join(LAB, 'ex5_learned.py')
    os.makedirs(tmp_path / 'repo' / 'exercises' / 'quickstart')  # the lab's own copy broken: restored, not named
    shutil.copy(ex5, tmp_path / 'repo' / 'exercises'), shutil.copy(os.path.join(HERE, 'model.py'), tmp_path / 'repo')
    shutil.copy(tmp_path / 'truncated' / 'ckpt.pt', tmp_path / 'repo' / 'exercises' / 'quickstart')
    cases = [((tmp_path / 'repo' / 'exercises' / 'ex5_learned.py', 'repo/exercises/quickstart'),
              "ckpt.pt cannot be read (RuntimeError); restore the lab's copy: git checkout exercises/quickstart"),
((os.path.join(LAB, 'ex1_pendulum.py'), 'bogus'), 'cat exercises/ex6_mine.py >> model.py'),
             ((os.path.join(LAB, 'ex2_jacobian.py'), 'leapfrog', 'bogus'), 'cat exercises/ex6_mine.py >> model.py'),
             ((ex5, 'standard'), 'python train.py --attn=coupled'), ((ex5, 'short'), 'block_size 32'),
             ((ex5, 'truncated'), 'cannot be read'), ((ex5, 'noval'), 'run `python prepare_data.py`'),
             ((os.path.join(LAB, 'ex6_train.py'), 'coupled', '--seeds', '1', '--jobs', '0'), '--jobs 0: give 1 or more'),
             ((os.path.join(LAB, 'ex6_train.py'), 'coupled', '--seeds', '1', '-1'), '--seeds -1: a seed is 0 or more'),
             ((os.path.join(LAB, 'ex6_train.py'), 'bogus'), '--attn=bogus is unknown'),
             ((os.path.join(LAB, 'ex6_train.py'), 'mine'), 'append the template first: cat exercises/ex6_mine.py'),
             ((os.path.join(LAB, 'ex6_train.py'), '--seeds', 'one'), "argument --seeds: invalid int value: 'one'"),
             ((os.path.join(LAB, 'ex3_scores.py'), 'now'), 'ex3_scores.py takes no arguments'),
             ((os.path.join(LAB, 'ex4_linear_regime.py'), '--fast'), 'ex4_linear_regime.py takes no arguments'),
             ((ex5, ''), 'the run folder is empty'), ((ex5, 'standard/ckpt.pt'), 'python train.py --attn=coupled')]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: run(*case[0], cwd=tmp_path), cases))
        helps = list(pool.map(lambda s: run(os.path.join(LAB, s), '--help', cwd=tmp_path), (
            'ex1_pendulum.py', 'ex2_jacobian.py', 'ex3_scores.py', 'ex4_linear_regime.py', 'ex5_learned.py')))
    for (argv, words), r in zip(cases, results):
        assert one_line_error(r, words), (argv[1:], r.stderr[-2000:])
    for n, r in enumerate(helps, 1):  # --help: the docstring, and nothing run
        assert r.returncode == 0 and r.stdout.startswith(f'Exercise {n}.') and r.stderr == '', (n, r.stderr[-2000:])
