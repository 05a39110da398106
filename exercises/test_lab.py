"""The lab (exercises/): each script run as a student runs it, from the repository root, and held to the numbers
WORKSHEET.md's "Look for" paragraphs state; the formulas of the pre-read and of ANSWERS.md rebuilt and checked against
the code; the launcher of exercise 6. Run from the repository root: python -m pytest -q exercises/test_lab.py
"""
import dataclasses
import hashlib
import importlib
import itertools
import math
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's scripts
import model as M  # noqa: E402
from model import FORCES, INTEGRATORS, GPT, GPTConfig, Hamiltonian, Integrator
from conftest import (CLAIMS, HERE, SMALL, Elementwise, Pendulum, assert_integrator_keeps, hamiltonian, jacobian_det,
                      one_head, one_line_error, qk_pair, run, step_size, yoshida)


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
           "model.INTEGRATORS['mine'] = model.Integrator(model.dkd, True, True, True, order=2, forces=1,"
           " vector_ops=5)\n")
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
    """Exercise n's section (or 'Discussion', 'Pre-read') of WORKSHEET.md or ANSWERS.md, on one line."""
    return ' '.join(re.split(r'\n## ', text.split(f'\n## {n}' + ('. ' if isinstance(n, int) else ''))[1])[0].split())


def repository(tmp_path, mine=1):
    """A copy of the repository's scripts in tmp_path/repo, the template appended `mine` times to its model.py."""
    repo = tmp_path / 'repo'
    for folder in ('', 'results', 'exercises'):
        os.makedirs(repo / folder, exist_ok=True)
        for name in (n for n in os.listdir(os.path.join(HERE, folder)) if n.endswith('.py')):
            shutil.copy(os.path.join(HERE, folder, name), repo / folder / name)
    (repo / 'model.py').write_text((repo / 'model.py').read_text() + lab_text('ex6_mine.py') * mine)
    return repo


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

    def launcher():  # exercise 6's homework: the template appended to (a copy of) model.py, a tiny run of it, twice
        repo = repository(tmp_path_factory.mktemp('launcher'))
        train = lambda *flag: run(repo / 'exercises' / 'ex6_train.py', 'mine', '--seeds', '1', '--',  # noqa: E731
                                  f'--data_dir={corpus}', *SMALL, '--n_embd=32', '--max_iters=2', '--eval_interval=2',
                                  *flag, cwd=repo, timeout=300)
        return 'launcher', (train(), train('--learning_rate=2e-3'), repo)  # a flag at train.py's default: the same run

    def mine():  # exercise 6's step 2 as a student runs it, on the template appended to (a copy of) model.py
        repo = repository(tmp_path_factory.mktemp('mine'))
        r = run('-m', 'pytest', '-v', '-p', 'no:cacheprovider', f'--basetemp={repo / "tmp"}', 'test_model.py',
                'exercises/test_lab.py', '-k', 'mine', cwd=repo, env={'PYTHONDONTWRITEBYTECODE': '1'}, timeout=300)
        return 'mine', (r.stdout, r.stdout[-2000:] + r.stderr if r.returncode else '')
    with ThreadPoolExecutor(2) as pool:  # two cores
        jobs = [pool.submit(launcher), pool.submit(mine), *(pool.submit(one, key) for key in (
            1, 4, 2, 3, 5, 6, '3 without matplotlib', '5 without matplotlib'))]
        return dict(job.result() for job in jobs) | {'root': root}


def lab_output(lab, key):
    out, error = lab[key][:2]
    assert error == '', error[-2000:]
    return out


# The worksheet's minutes: a student's, from run-throughs; no test asserts a time
PARTS = ('Pre-read', 'Start the quick start', 1, 2, 3, 4, 5, 6, 'Discussion')  # the pre-read: before class


def test_lab_is_laid_out_and_its_minutes_add_up_to_90():
    worksheet, answers = lab_text('WORKSHEET.md'), lab_text('ANSWERS.md')
    rows = re.findall(r'\n\| ([^|]+) \| (\d+) \| (\d+) \| [^|]+ \|', worksheet.split('\n## ')[0])
    assert len(rows) == len(PARTS), rows
    total = sum(int(minutes) for _, minutes, _ in rows[1:])  # in class
    said = f"The minutes in class add up to {total}; the install and the pre-read come before."
    assert total <= 90 and said in worksheet, f"the minutes in class add up to {total}"
    pre = lab_section('Pre-read', worksheet)
    stated_words, stated_minutes = map(int, re.search(r'pre-read is about (\d+) words, (\d+) minutes', pre).groups())
    assert abs(len(pre.split()) - stated_words) < 50 and stated_minutes == math.ceil(len(pre.split()) / 200), (
        f"the pre-read says about {stated_words} words, {stated_minutes} minutes; it has {len(pre.split())} words")
    assert f"## Pre-read ({rows[0][1]} minutes)" in worksheet
    assert all(f'`{name}`' in pre for name in ('standard', 'coupled', 'euler', 'coupled-mlp'))
    assert all(word in pre for word in ('*symplectic*', '*symmetric*', '*order*', '*spread*', '*free force*',
                                        'linear-regime trap', '*nonlinear fraction*'))
    for n in range(1, 7):
        section = lab_section(n, worksheet)
        assert all(part in section for part in ('**Predict first.**', '**Run**', '**Look for:**')), n
        assert len(lab_section(n, answers)) > 300, n  # an answer, and how to judge one
    for n in (*range(1, 7), 'Homework'):
        section = lab_section(n, worksheet)
        for script in re.findall(r'python (exercises/\S+\.py)', section) + re.findall(r'cat (exercises/\S+)', section):
            assert os.path.exists(os.path.join(HERE, script)), script
    # exercise 6's step 3, in class, is the run its Look for quotes; the homework comes after the discussion
    assert f"`python exercises/{' '.join(LAB_RUNS[6][0])}`" in lab_section(6, worksheet)
    assert worksheet.index('\n## Discussion\n') < worksheet.index('\n## Homework')
    assert lab_section('Discussion', worksheet).endswith('?') and 'A good answer' in lab_section('Discussion', answers)
    assert not re.search(r'\b[Cc]orrection [A-G]\b', answers)  # answers, not a history of them
    # exercise 6 gives the step's cost; counting (how, and the hint card) is the homework's
    six, homework = lab_section(6, worksheet), lab_section('Homework', worksheet)
    assert six.index('**Run**') < six.index('**Look for:**') and '**The hint card' not in six and '| 5 |' not in six
    assert homework.index('**How to count.**') < homework.index('**The hint card') < homework.index('**Train one.**')
    # the homework trains in the laptop results' protocol, so its rows compare with the table's; the README points here
    readme = open(os.path.join(HERE, 'README.md'), encoding='utf-8').read()
    laptop = open(os.path.join(HERE, 'results', 'laptop.md'), encoding='utf-8').read()
    launcher = lab_text('ex6_train.py')
    assert re.search(r'PROTOCOL = "(.*?)"', launcher).group(1) == re.search(r'\nP="(.*?)"\n', laptop).group(1)
    assert all(f'exercises/{name}' in readme for name in ('WORKSHEET.md', 'ANSWERS.md'))
    assert readme.index('\n## Glossary\n') < readme.index('\n## Classroom exercises\n')  # words before their use
    # the discussion's numbers are the results': the paper's gain, standard-2.4x's lead, the nonlinear fractions, the t
    discussion = lab_section('Discussion', answers)
    assert 'gains 6.6% at 60M' in lab_section('Discussion', worksheet) and '-6.6% validation perplexity' in readme
    row = lambda name: re.search(rf'\n\| `{re.escape(name)}` \| (.*)', laptop).group(1)  # noqa: E731
    lead = float(re.search(r'\((-[\d.]+)%\)', row('standard-2.4x')).group(1))
    assert f"`standard-2.4x` is {-lead:.0f}% better" in discussion
    quoted = lab_section('Discussion', worksheet)  # the worksheet quotes them, so students need not read the results
    assert f"2.4 times the tokens, `standard` lowers its perplexity by {-lead:.0f}%" in quoted
    nonlinear = lambda name: [float(x) for x in re.search(r'([\d.]+)-([\d.]+)% \|$', row(name)).groups()]  # noqa
    low, high = map(int, re.search(r'nearly linear \((\d+)% to (\d+)%', discussion).groups())
    assert (low, high) == (math.floor(nonlinear('coupled')[0]), math.ceil(nonlinear('coupled')[1]))
    assert f"`coupled` ends {low}% to {high}% nonlinear" in quoted
    helped = [x for name in ('uncoupled', 'invertible') for x in nonlinear(name)]
    low, high = map(int, re.search(r'`uncoupled` and `invertible` reach (\d+)% to (\d+)%', discussion).groups())
    assert (low, high) == (math.floor(min(helped)), math.ceil(max(helped)))
    assert f"end {low}% to {high}% nonlinear. Both end ahead of `coupled`" in quoted
    change = lambda name: [float(x) for x in re.findall(r'\(([-+][\d.]+)%\)', row(name))]  # noqa: E731  per corpus
    ahead = [(change(name), change('coupled')) for name in ('uncoupled', 'invertible')]
    assert all(len(x) == len(c) == 3 and all(map(float.__lt__, x, c)) for x, c in ahead), ahead
    ts = [float(t) for part in re.findall(r'(?:Uncoupled|invertible) beats coupled by\s[^(]*\(t = ([\d., ]+)\)', laptop)
          for t in part.split(', ')]
    low, high = map(float, re.search(r'lead over coupled has t from ([\d.]+) to ([\d.]+)', discussion).groups())
    assert len(ts) == 6 and (low, high) == (min(ts), max(ts)), ts
    # one rule for the noise, the README's, in the discussion and the homework: |t| >= 2 is beyond it
    assert 'A difference with `|t|` under 2 is within the noise of three seeds.' in ' '.join(readme.split())
    assert 'counts a difference with `|t|` of 2 or more as beyond the noise of three seeds' in discussion
    beyond, of = map(int, re.search(r'By that rule (\d) of those (\d) leads are beyond it', discussion).groups())
    pubmed = re.search(r'`invertible` beats coupled on both, by [\d.]+% \(t = [\d.]+\) and [\d.]+% \(t = ([\d.]+)\)',
                       laptop).group(1)
    assert (beyond, of) == (sum(t >= 2 for t in ts), len(ts)) and f"invertible's lead on PubMed, t = {pubmed}" in \
        discussion and float(pubmed) >= 2, (beyond, ts, pubmed)
    error = stated_formula(r'twice the standard error of their difference, `(.*?)` for the two rows. standard '
                           r'deviations `s_1` and `s_2`', lab_section('Homework', worksheet))
    for s1, s2 in ((0.1, 0.3), (2.0, 0.5)):  # three seeds each: results/sizes.py's t_of
        assert abs(formula(error, s_1=s1, s_2=s2) - math.sqrt(s1 ** 2 / 3 + s2 ** 2 / 3)) < 1e-12, error


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
    # the pre-read's check of the install: exercise 1's last line, as the loop above holds it
    assert "`python exercises/ex1_pendulum.py | tail -1` should then print one line, `drew ex1_pendulum.png`, or " \
           "without matplotlib a line that says how to get it" in lab_section('Pre-read', lab_text('WORKSHEET.md'))
    assert "savefig('ex1_pendulum.png'" in lab_text('ex1_pendulum.py')
    assert lab_output(lab, 5).startswith('exercises/quickstart/ckpt.pt: iteration 2000 of 2000\n')  # a finished run
    r = run(os.path.join(LAB, 'ex5_learned.py'), cwd=lab['root'])  # before the quick start has saved its run
    assert one_line_error(r, 'exercises/quickstart')


# What each number of an exercise's "Look for" paragraph is, in order, read off what its script printed: (the value,
# or values that must all agree, and how close). A number in backticks is code, not a figure. How close:
#   digits:   a printed figure, to the digits the worksheet gives (half a unit in its last place);
#   power2:   a growth factor the worksheet rounds to a power of 2 ("a factor of 4"), within a quarter of a power of 2;
#   order:    the order p of that factor 2^p ("order 2"), within 0.25;
#   roundoff: a rounding error, which moves with the CPU kernel and its math library: the worksheet gives a bound, and
#             the value lies below it (test_lab_round_off_bounds_fail_when_the_property_breaks holds each bound).
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
    det = re.findall(r'det J - \(1 \+ dt\^2 cos q\) along the orbit: at most (\S+)', out)  # Euler's, if asked for
    assert bool(det) == ('euler' in halving), f"Euler's det J line comes exactly when euler is asked for:\n{out}"
    return e, halving, long, float(det[0]) if det else None


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
    """Per layer (nonlinear %, [dt]); per head (R^2 of dt k_i.k_j alone, R^2 of the first-order formula, rows of 48
    where the diagonal's score rises, rows where its attention falls)."""
    layers = [(float(f), [float(x) for x in re.findall(r'[-\d.]+', dt)]) for f, dt in figures(
        out, r'layer \d: nonlinear ([\d.]+)%, dt (\[.*?\])')]
    heads = [tuple(map(float, row)) for row in figures(
        out, r'head \d: R\^2 (\S+) \(dt k_i.k_j alone\), (\S+) \(first order\); the diagonal.s score rises in '
             r'(\d+)/48 rows, its attention falls in (\d+)/48')]
    return layers, heads


def exercise_5_figures(out):
    layers, heads = exercise_5_rows(out)
    extremes = lambda values: [(min(values), 'digits'), (max(values), 'digits')]  # noqa: E731  a range "a to b"
    column = lambda i: [h[i] for h in heads]  # noqa: E731
    return [(layers[0][0], 'digits'), (tuple(f for f, _ in layers[1:]), 'digits'),
            *extremes([dt for _, dts in layers for dt in dts]), *extremes(column(1)), *extremes(column(0)),
            (tuple(column(2)), 'digits'), *extremes(column(3))]


def exercise_6_figures(out):  # the reference drift-kick-drift: exercise 1's lines for it
    e, halving, _, _ = exercise_1_rows(out)
    ratios, slope = halving['mine']
    return [(e['mine', 0.1], 'digits'), (e['mine', 0.05], 'digits'), (tuple(ratios), 'digits'), (slope, 'digits')]


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
    return value < x


def look_for(n, text=None):  # the paragraph, up to its picture or the next bold heading (exercise 5's explanation)
    return lab_section(n, text or lab_text('WORKSHEET.md')).split('**Look for:** ')[1].split(' ![')[0].split(' **')[0]


GIVES = {'digits': lambda v: f"the script gives {v}",  # what the script's value means, by how it is checked
         'power2': lambda v: f"the script's factor is {v:.2f}, 2^{math.log2(v):.2f}",
         'order': lambda v: f"the script's factor {v:.2f} is order log2({v:.2f}) = {math.log2(v):.2f}",
         'roundoff': lambda v: f"a bound the script's {v} exceeds"}


def look_for_mismatches(n, out, text=None):
    """Where exercise n's "Look for" paragraph in WORKSHEET.md (or `text`) disagrees with what its script printed:
    the words up to the number, the number, and what the script gives."""
    paragraph = look_for(n, text)
    numbers, expected = stated(paragraph), LOOK_FOR[n](out)
    if len(numbers) != len(expected):
        return [f"exercise {n}'s Look for states {len(numbers)} numbers, its check reads {len(expected)}: "
                f"{[t for _, _, t in numbers]}"]
    return [f"exercise {n} at '...{' '.join(paragraph[:end].split()[-6:])}': the worksheet says {said}, "
            f"{GIVES[how](values)} ({how})" for (_, end, said), (values, how) in zip(numbers, expected)
            if not all(close(said, v, how) for v in (values if isinstance(values, tuple) else (values,)))]


@pytest.mark.parametrize('n', sorted(LOOK_FOR))
def test_lab_look_for_states_what_its_script_prints(lab, n):
    mismatches = look_for_mismatches(n, lab_output(lab, n))
    assert not mismatches, '; '.join(mismatches)


def test_lab_look_for_check_fails_when_a_worksheet_number_changes(lab):
    # on a scratch copy of WORKSHEET.md: change a number of a "Look for" paragraph (its first by a digit, then each
    # by 20x) and the check above fails
    worksheet = ' '.join(lab_text('WORKSHEET.md').split())
    for n in LOOK_FOR:  # (a bound of round-off is held by the next test: a larger bound still holds)
        out, paragraph = lab_output(lab, n), look_for(n)
        numbers = [number for number, (_, how) in zip(stated(paragraph), LOOK_FOR[n](out)) if how != 'roundoff']
        start, end, text = numbers[0]
        first = re.search(r'[1-9]', text)  # its first significant digit, one up (9: down to 1)
        changed = text[:first.start()] + str(int(first.group()) % 9 + 1) + text[first.end():]
        for start, end, changed in [(start, end, changed)] + [(s, e, f"{20 * float(t):g}") for s, e, t in numbers
                                                           if float(t)]:  # (20 x 0 is 0)
            scratch = worksheet.replace(paragraph, paragraph[:start] + changed + paragraph[end:])
            assert look_for_mismatches(n, out, scratch.replace(' ## ', '\n## ')), (n, changed)


def test_lab_round_off_bounds_fail_when_the_property_breaks(lab):
    # exercise 2 with Euler's step in leapfrog's place: neither the returns nor J^T Omega J are round-off any more,
    # and the check names each of the worksheet's four bounds
    broken = (f"import sys; sys.path.insert(0, {HERE!r}); import model\n"
              "dict.__setitem__(model.INTEGRATORS, 'leapfrog', model.INTEGRATORS['euler'])\n")
    r = run(os.path.join(LAB, 'ex2_jacobian.py'), cwd=lab['root'], patch=broken)
    bounds = [text for (_, _, text), (_, how) in zip(stated(look_for(2)), exercise_2_figures(lab_output(lab, 2)))
              if how == 'roundoff']
    exceeded = [m for m in look_for_mismatches(2, r.stdout) if m.endswith('(roundoff)')]
    assert len(bounds) == len(exceeded) == 4 and all(f"says {b}," in m for b, m in zip(bounds, exceeded)), exceeded

def formula(text, **names):
    """A formula as the worksheet and ANSWERS.md write it, evaluated: `dt^2/2 F(q)` is dt**2/2*F(q), `|k|` a norm,
    `a . b` a dot product, `cos q` cos(q); names: its symbols' values."""
    py = re.sub(r'\b(cos|sin) (\w+)', r'\1(\2)', text)
    py = re.sub(r'\|([^|]+)\|', r'norm(\1)', py).replace('^', '**').replace(' . ', ' @ ')
    py = re.sub(r'(?<=[\w)]) +(?=[\w(])', '*', py)  # juxtaposition: a product
    return eval(py, {'__builtins__': {}, 'norm': torch.linalg.vector_norm, 'cos': math.cos, 'sqrt': math.sqrt}, names)


def steps(text, h, q, k, dt):
    """A step written as the worksheet writes one, `k += dt/2 F(q); q += dt k; ...`, applied to (q, k)."""
    state = dict(q=q, k=k)
    for statement in text.split('; '):
        name, expression = statement.split(' += ')
        state[name] = state[name] + formula(expression, dt=dt, F=h.force, **state)
    return state['q'], state['k']


def stated_formula(pattern, text):  # the formula a pattern's group finds in an answer (or the worksheet)
    found = re.search(pattern, text)
    assert found, f"no {pattern!r} in the text"
    return found.group(1)


def number_in(pattern, text):
    return float(stated_formula(pattern, text))


class Spring(Hamiltonian):  # V(q) = c q^2/2, F(q) = -c q
    c = 1.0

    def force(self, q, scale=1.0):
        return -scale * self.c * q


def spring(integrator, dt, c=1.0, steps=1):
    h = type('Spring', (Spring,), dict(c=c))(1, 1, 1, steps, integrator, dt=dt).double()
    with torch.no_grad():
        h.dt.fill_(dt)
    return h


def one_d(h, x):  # a step of a one-dimensional h: (q, k) -> (q, k), flat
    return torch.cat(h(x[:1].view(1, 1, 1, 1), x[1:].view(1, 1, 1, 1)), -1).flatten()


def orbit(h, steps, x=(1.0, 0.0)):  # [(q, k)] over `steps` steps of h, from rest at q = 1
    x, out = torch.tensor(x, dtype=torch.float64), []
    with torch.no_grad():
        for _ in range(steps + 1):
            out.append(tuple(x.tolist()))
            x = one_d(h, x)
    return out


def energy_error(h, H, steps):  # the largest |H - H0| over `steps` steps of h from rest at q = 1; |q| at the end
    states = orbit(h, steps)
    return max(abs(H(*x) - H(*states[0])) for x in states), abs(states[-1][0])


def pendulum_energy_error(integrator, dt):  # exercise 1's: the largest |H - H0| to time 20, H = 1/2 k^2 - cos q
    return energy_error(Pendulum(1, 1, 1, 1, integrator, dt=dt).double(), PENDULUM, round(20 / dt))[0]


PENDULUM = lambda q, k: 0.5 * k ** 2 - math.cos(q)  # noqa: E731  its energy H


def silu_derivatives(z, n=3):  # silu', silu'', silu''' at z, by autograd
    z = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    out, y = [], F.silu(z)
    for _ in range(n):
        (y,) = torch.autograd.grad(y, z, create_graph=True)
        out.append(y.item())
    return out


def test_lab_the_worksheets_formulas_are_the_models():
    # the pre-read's Euler step, the hint card's leapfrog and drift-kick-drift, Yoshida's weights, silu' near zero and
    # the free force's Jacobian; exercises 1 and 3's formulas are the answers' (checked there)
    worksheet = lab_text('WORKSHEET.md')
    pre, card = lab_section('Pre-read', worksheet), lab_section('Homework', worksheet).split('**The hint card')[1]
    h, (q, k) = hamiltonian('leapfrog', nh=1), qk_pair(nh=1)
    dt = h.dt.view(-1, 1, 1)
    euler = stated_formula(r'old state, `q, k = (.*?)`', pre)
    assert 'Leapfrog has order 2 and explicit Euler order 1.' in pre and (INTEGRATORS['leapfrog'].order,
                                                                           INTEGRATORS['euler'].order) == (2, 1)
    # no position map acts on q and k after the step (rope would rotate them), so a constant shift of k drops out
    assert 'adds learned position embeddings to the token' in pre and GPTConfig().pos == 'learned'
    assert torch.allclose(torch.cat(formula(euler, q=q, k=k, dt=dt, F=h.force)), torch.cat(M.euler(h, q, k, dt)),
                          atol=1e-12), f"the pre-read's explicit Euler `q, k = {euler}` is not the model's euler"
    for name, step in (('`leapfrog` (the template)', M.leapfrog), ('drift-kick-drift', lab_step('dkd'))):
        text = stated_formula(rf'\| {re.escape(name)} \| `(.*?)` \|', card)
        assert torch.allclose(torch.cat(steps(text, h, q, k, dt)), torch.cat(step(h, q, k, dt)), atol=1e-12), (
            f"the hint card's {name} `{text}` is not that step")
    w1, w0 = stated_formula(r'`w1 = (.*?)`', card), stated_formula(r'`w0 = (.*?)`', card)
    weights = formula(w1), formula(w0.replace('w1', str(formula(w1))))

    def weighted(h, q, k, dt):  # three leapfrog steps of w1 dt, w0 dt, w1 dt
        for w in (weights[0], weights[1], weights[0]):
            q, k = M.leapfrog(h, q, k, w * dt)
        return q, k
    ratio = keeps(weighted, symplectic=True, volume_preserving=True, symmetric=True, order=4)
    assert 14 < ratio < 18, f"the hint card's Yoshida weights `w1 = {w1}`, `w0 = {w0}` give errors {ratio:.1f}x " \
        "smaller per halving of dt, not 2^4"
    # silu' near zero, wherever the lab or the README states it: each statement (the pre-read has two) is checked
    texts = worksheet + lab_text('ANSWERS.md') + open(os.path.join(HERE, 'README.md'), encoding='utf-8').read()
    series = re.findall(r"`silu'\(z\)\s+=\s+([^`]*?)\s+\+\s+(O\(z\^3\)|\.\.\.)`", texts) + [
        (p, 'O(z^3)') for p in re.findall(r"first-order\s+polynomial(?:\s+is)?\s+`([^`]*)`", texts)]
    assert len(series) == 5, series
    for polynomial, rest in series:  # silu'(z) - the polynomial: O(z^3) (so no z^2 term), or with z^3's, O(z^5)
        power = 3 if rest == 'O(z^3)' else 5
        for z in (1e-2, 5e-3):
            off = silu_derivatives(z, 1)[0] - formula(polynomial, z=z)
            assert abs(off / z ** (power - 1)) < 0.01, f"`silu'(z) = {polynomial} + {rest}`: off by {off:.1e} at z={z}"
    # the step's constant shift of q (from q = k = 0): dt^2/2 F(0), leapfrog's
    shift = stated_formula(r"The step's constant shift of `q`, `(.*?)`", pre)
    zero = torch.zeros_like(q)
    assert torch.allclose(formula(shift, dt=dt, F=lambda _: h.force(zero)), M.leapfrog(h, zero, zero, dt)[0],
                          atol=1e-12), f"the pre-read's shift of q `{shift}` is not leapfrog's from q = k = 0"
    # the term that shift adds to score (i, j): the same down a column, changing along a row (the softmax keeps it)
    term, F0 = stated_formula(r"the term it adds to score `\(i, j\)`, `(.*?)`", pre), h.force(zero)[0, 0, 0]
    change = (q + formula(shift, dt=dt, F=lambda _: h.force(zero))) @ k.mT - q @ k.mT  # (B, 1, T, T)
    stated = torch.stack([formula(term, dt=dt.item(), F=lambda _: F0, k_j=k[0, 0, j]) for j in range(k.size(2))])
    assert torch.allclose(change[0, 0], stated.expand_as(change[0, 0]), atol=1e-12) and stated.std() > 0.01, (
        f"the pre-read's term `{term}` added to score (i, j) by the shift of q")
    assert "Its Jacobian `A diag(silu'(W q + b)) W`" in pre  # as answer 2 states it: checked there
    assert '`--qk_scale` sets the spread by scaling `W`; it leaves `q` as it is' in pre  # checked in answer 4's


def test_lab_answer_1_the_pendulum_holds_its_numbers_and_formulas(lab):
    answer = lab_section(1, lab_text('ANSWERS.md'))
    e, halving, long, det_gap = exercise_1_rows(lab_output(lab, 1))
    # Euler's determinant, exactly: the formula as written against autograd at points far from the bottom
    det, jacobian = stated_formula(r'exactly `det J = (.*?)`', answer), stated_formula(r'the Jacobian `(.*?)`', answer)
    for q, dt in ((1.0, 0.1), (2.5, 0.7), (-0.3, 1.3)):
        h = Pendulum(1, 1, 1, 1, 'euler', dt=dt).double()
        h.dt.data.fill_(dt)  # (not float32's 0.1)
        J = torch.autograd.functional.jacobian(lambda x: one_d(h, x), torch.tensor([q, 0.4], dtype=torch.float64))
        assert torch.allclose(J, torch.tensor(formula(jacobian, dt=dt, q=q), dtype=torch.float64)), jacobian
        assert abs(torch.linalg.det(J).item() - formula(det, dt=dt, q=q)) < 1e-12, f"`det J = {det}` at q={q}, dt={dt}"
    assert det_gap < 1e-12 and f"determinant is exactly `{det}`" in lab_section(1, lab_text('WORKSHEET.md'))
    # growing areas are not growing energy: the energy one Euler step adds is the stated Delta H, up to O(dt^3)
    gain = stated_formula(r'`Delta H = (.*?)` up to `O\(dt\^3\)`', answer)
    left = [abs(PENDULUM(0.7 + dt * 0.4, 0.4 - dt * math.sin(0.7)) - PENDULUM(0.7, 0.4)
                - formula(gain, dt=dt, q=0.7, k=0.4, sin=math.sin)) for dt in (0.02, 0.01)]
    assert 7 < left[0] / left[1] < 9, f"`Delta H = {gain}` leaves {left[0] / left[1]:.1f}x per halving, not 8 (O(dt^3))"
    # over a swing the gain per step averages to dt^2 times the mean of sin(q)^2 (k^2 cos q = d/dt (k sin q) + sin^2)
    states = orbit(Pendulum(1, 1, 1, 1, 'euler', dt=0.005).double(), round(6.70 / 0.005))  # a period from rest
    gains = sum(PENDULUM(*b) - PENDULUM(*a) for a, b in zip(states, states[1:]))
    assert 'the gain per step averages to `dt^2` times the mean of `sin(q)^2`' in answer
    assert abs(gains / (0.005 ** 2 * sum(math.sin(q) ** 2 for q, _ in states[:-1])) - 1) < 0.05
    # leapfrog conserves the stated modified energy of the spring exactly (to rounding), not H
    energy = stated_formula(r'modified energy `(.*?)` exactly', answer)
    kept = energy_error(spring('leapfrog', 0.3), lambda q, k: formula(energy, k=k, q=q, dt=0.3), 200)[0]
    assert kept < 1e-12 < 1e-3 < energy_error(spring('leapfrog', 0.3), lambda q, k: (k ** 2 + q ** 2) / 2, 200)[0], (
        f"leapfrog does not conserve `{energy}` exactly: {kept:.1e}")
    # Euler's error at dt = 0.1 and 0.05 relative to |H0| = cos 1, its factors per halving, the slope
    euler, slope = halving['euler']
    for dt, percent in zip((0.1, 0.05), map(int, re.search(r'energy error is (\d+)% of `\|H0\| = cos 1`, and at `dt = '
                                                          r'0.05` it is still (\d+)%', answer).groups())):
        worst = pendulum_energy_error('euler', dt)  # the script prints it to 2 digits: here, all of them
        assert f"{worst:.1e}" == f"{e['euler', dt]:.1e}" and abs(percent - 100 * worst / math.cos(1)) < 0.5, (
            f"Euler's error at dt = {dt} is {100 * worst / math.cos(1):.1f}% of cos 1, not {percent}%")
    assert number_in(r'`dt = 0.05` is ([\d.]+), not 2', answer) == euler[0] and euler[0] > 2.1
    reaches, a, b = re.search(r'reaches ([\d.]+) only at the halving from `dt = ([\d.]+)` to `dt = ([\d.]+)`',
                              answer).groups()
    assert float(reaches) == euler[-1] and (float(a), float(b)) == (0.1 / 2 ** 4, 0.1 / 2 ** 5)
    assert all(r > 2.05 for r in euler[:-1]) and euler[-1] < 2.05  # "only" there
    assert number_in(r'six step sizes, ([\d.]+),', answer) == slope
    assert number_in(r"factor is ([\d.]+) at every halving", answer) == halving['leapfrog'][0][0]
    # the bound's conditions: a dt below the stability limit (2 for the spring), a bounded orbit (V = -q^2/2: the
    # modified energy is kept, H is not); the model takes one step by default
    assert number_in(r'unstable once `dt > (\d+)`', answer) == 2
    worst = lambda h, steps=400: energy_error(h, lambda q, k: (k ** 2 + h.c * q ** 2) / 2, steps)  # noqa: E731
    assert worst(spring('leapfrog', 1.9))[0] < 10 < 1e6 < worst(spring('leapfrog', 2.1))[0]
    # at dt = 2 exactly: linear growth (twice as far after twice the steps), except from rest
    assert 'At `dt = 2` exactly the orbit grows linearly with the number of steps, unless it starts at rest: then ' \
           'it swings between `q` and `-q`' in answer
    moving, at_rest = orbit(spring('leapfrog', 2.0), 400, x=(1.0, 0.5)), orbit(spring('leapfrog', 2.0), 400)
    assert abs(moving[400][0] / moving[200][0] - 2) < 0.05 and set(at_rest) == {(1.0, 0.0), (-1.0, 0.0)}, (
        f"leapfrog at dt = 2 on the spring: q = {moving[200][0]:.1f} after 200 steps, {moving[400][0]:.1f} after 400; "
        f"from rest it visits {set(at_rest)}")
    runaway, inverted = (worst(spring('leapfrog', 0.1, c=-1.0), n) for n in (40, 80))
    assert inverted[0] > 10 * runaway[0] and inverted[1] > 10 * runaway[1]  # grows with q^2 as the orbit runs away
    assert '`--qk_steps=1`' in answer and GPTConfig().qk_steps == 1
    # the long run: leapfrog bounded (the same bound at the end as at the start), Euler drifting
    assert long['leapfrog'][1] <= 1.01 * long['leapfrog'][0] and long['euler'][1] > 5 * long['euler'][0]


def test_lab_answer_2_volume_return_symplecticity_hold_their_formulas(lab):
    answer = lab_section(2, lab_text('ANSWERS.md'))
    rows = exercise_2_rows(lab_output(lab, 2))
    # the kick's and the drift's Jacobians, as written (blocks of (q, k)), against autograd; the drift is always
    # symplectic, the kick exactly when dF/dq is symmetric (the potential's force: yes; the free force: no)
    kick_J = stated_formula(r'A kick `k \+= dt/2 F\(q\)` has the Jacobian `(.*?)`', answer)
    drift_J = stated_formula(r'a drift `q \+= dt k` has `(.*?)`', answer)
    n, dt = 4, 0.3
    I, Omega = torch.eye(n, dtype=torch.float64), torch.zeros(2 * n, 2 * n, dtype=torch.float64)
    Omega[:n, n:], Omega[n:, :n] = I, -I
    def blocks(text, G, c=None):  # the block matrix a formula states, with I and G = dF/dq (the pre-read's: time c)
        rows = formula(text.replace('dF/dq', 'G'), I=I, dt=dt, G=G, c=c)
        return torch.cat([torch.cat([b if torch.is_tensor(b) else b * I for b in row], 1) for row in rows], 0)
    pre = lab_section('Pre-read', lab_text('WORKSHEET.md'))  # the same, for a kick and a drift of time c
    pre_kick_J, pre_drift_J = (stated_formula(pattern, pre) for pattern in (
        r"A kick's Jacobian is `(.*?)`", r"and a drift's is `(.*?)`"))
    assert 'A drift is always symplectic. A kick is symplectic exactly when `dF/dq` is symmetric' in pre
    x = torch.randn(2 * n, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    assert '`dF/dq = -Hess V`' in answer and 'The drift is always symplectic' in answer
    for force, symmetric in (('potential', True), ('mlp', False)):
        f = hamiltonian('leapfrog', nh=1, hs=n, force=force)
        force_of = lambda q: f.force(q.view(1, 1, n)).flatten()  # noqa: E731
        G = torch.autograd.functional.jacobian(force_of, x[:n])
        kick = torch.autograd.functional.jacobian(lambda x: torch.cat((x[:n], x[n:] + dt / 2 * force_of(x[:n]))), x)
        drift = torch.autograd.functional.jacobian(lambda x: torch.cat((x[:n] + dt * x[n:], x[n:])), x)
        assert torch.allclose(blocks(kick_J, G), kick, atol=1e-12), f"the kick's Jacobian is not `{kick_J}`"
        assert torch.allclose(blocks(drift_J, G), drift), f"the drift's Jacobian is not `{drift_J}`"
        for text, J, c in ((pre_kick_J, kick, dt / 2), (pre_drift_J, drift, dt)):  # the pre-read's, c = dt/2 and dt
            assert torch.allclose(blocks(text, G, c=c), J, atol=1e-12), f"the pre-read's `{text}`, of time c = {c}"
        assert (drift.T @ Omega @ drift - Omega).abs().max() < 1e-12
        assert ((kick.T @ Omega @ kick - Omega).abs().max() < 1e-12) == symmetric == bool((G - G.T).abs().max() < 1e-12)
    # a symplectic Jacobian's singular values pair as s, 1/s (the stretch and squeeze printed); Euler's do not
    assert '`s`, `1/s`' in answer
    stretch, squeeze = re.search(r'a stretch by ([\d.]+) comes with a squeeze by ([\d.]+)', answer).groups()
    assert (float(stretch), float(squeeze)) == (rows['leapfrog', 'float64'][5], rows['leapfrog', 'float64'][4])
    assert abs(rows['leapfrog', 'float64'][4] * rows['leapfrog', 'float64'][5] - 1) < 0.01
    assert abs(rows['euler', 'float64'][4] * rows['euler', 'float64'][5] - 1) > 0.5
    # a palindrome of steps that are not exact sub-flows (two Euler steps of dt/2) does not return
    h = hamiltonian('euler', steps=2, nh=1)
    q, k = qk_pair(nh=1)
    assert 'A palindrome alone is not enough' in answer and not torch.allclose(h(*h(q, k), dt=-h.dt)[0], q, atol=1e-3)
    # Euler's det J = det(I + dt^2 Hess V) (Hess V: the Hessian of V, a matrix; V below a unit)
    assert '`det J != 0`' in answer
    det = stated_formula(r"Euler's single step has `det J = (.*?)`", answer)
    h = hamiltonian('euler', hs=4, nh=1)
    x = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    hess = torch.autograd.functional.hessian(lambda q: h.f.V(q.view(1, 1, 1, 4)).sum(), x[:4])
    assert abs(jacobian_det(h, 4) - formula(det, det=torch.linalg.det, I=torch.eye(4, dtype=torch.float64),
                                            dt=h.dt.item(), Hess=hess, V=1).item()) < 1e-10, f"not `det J = {det}`"
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
    assert f"`q1_i . k1_j = {scores}`" in lab_section(3, lab_text('WORKSHEET.md')), f"the worksheet's: not `{scores}`"
    residual = {}
    for dt in (0.1, 0.05, 0.025):
        dt_ = torch.full((1,), dt, dtype=torch.float64)
        q1, k1 = h(q, k, dt=dt_)
        assert torch.allclose(q1, formula(q1_exact, q=q, k=k, dt=dt, F=h.force), atol=1e-12), (
            f"leapfrog's q1 is not exactly `{q1_exact}`")
        F = lambda x: h.force(x.view(1, 1, -1)).flatten()  # noqa: E731  a token's force
        first = torch.tensor([[formula(scores, q_i=q[0, 0, a], k_j=k[0, 0, b], k_i=k[0, 0, a], q_j=q[0, 0, b], dt=dt,
                                       F=F).item() for b in range(q.size(2))] for a in range(q.size(2))])  # (T, T)
        residual[dt] = ((q1[0, 0] @ k1[0, 0].T - first.double()).abs().max().item(),
                        (k1 - formula(k1_first, k=k, dt=dt, F=h.force, q=q)).abs().max().item())
    for a, b in ((0.1, 0.05), (0.05, 0.025)):  # both second order: a quarter per halving
        assert all(3.3 < x / y < 4.7 for x, y in zip(residual[a], residual[b])), (
            f"`q1_i . k1_j = {scores}` and `k1 = {k1_first}` must leave O(dt^2): {residual}")
    rows, slopes = exercise_3_rows(lab_output(lab, 3))
    said = re.search(r'integrators differ by `O\(dt\^(\d+)\)`: (\d+)% of the change at `dt = ([\d.]+)`', answer)
    assert said, "answer 3 no longer says 'the two integrators differ by `O(dt^p)`: N% of the change at `dt = ...`'"
    power, percent, at = said.groups()
    assert int(power) == round(slopes[2]), (
        f"answer 3: Euler and leapfrog differ by `O(dt^{power})`; exercise 3 measures a slope of {slopes[2]}")
    row = next(row for row in rows if row[0] == float(at))
    assert abs(100 * row[3] / row[1] - int(percent)) < 0.5, (
        f"answer 3: {percent}% of the change at dt = {at}; exercise 3 gives {100 * row[3] / row[1]:.1f}%")


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
    assert factor == 2 ** power and abs(growth[0] / factor - 1) < 0.05 and abs(slopes[0.0] - power) < 0.1, (
        f"`spread^{power}`, {factor}x per doubling: the script gives {growth[0]}x, slope {slopes[0.0]}")
    assert growth == sorted(growth, reverse=True) and growth[-1] < factor / 4  # slowing as SiLU bends away
    # with b != 0, silu'(b + z) has the stated z^2 term, silu'''(b) z^2/2 (silu''' vanishes only at 0)
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
    assert factor == 2 ** power and abs(biased[0] / factor - 1) < 0.05 and abs(slopes[0.5] - power) < 0.1, (
        f"`spread^{power}`, {factor}x per doubling with b != 0: the script gives {biased[0]}x, slope {slopes[0.5]}")
    assert number_in(r'shows ([\d.]+)x at the smallest', answer) == biased[0]


def layer_1_of_the_lab_copy():
    """The lab's copy of a quick-start run, as exercise 5 reads it: layer 1's q/k map, its (q, k) before and after on
    the printed line, (n_head, 48, hs) each."""
    ckpt = torch.load(os.path.join(LAB, 'quickstart', 'ckpt.pt'), weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']), verbose=False).eval()
    model.load_state_dict(ckpt['model'])
    val = torch.from_numpy(np.fromfile(os.path.join(LAB, 'quickstart', 'val.bin'), dtype=np.uint16).astype(np.int64))
    start = 1000 + bytes(val[1000:2000].to(torch.uint8).tolist()).index(b'\n') + 1
    qk, seen = model.transformer.h[1].attn.qk, []
    hook = qk.register_forward_hook(lambda m, inp, out: seen.append((*inp, *out)))
    with torch.no_grad():
        model(val[start:start + 48][None])
    hook.remove()
    return qk, [t[0] for t in seen[0]]


def test_lab_answer_5_the_learned_model_holds_its_numbers_and_formulas(lab):
    answer = lab_section(5, lab_text('ANSWERS.md'))
    # the score of (i, j) gains the stated first-order term: second order left over, every pair, the diagonal too
    score_gain = stated_formula(r'To first order in `dt`, the score of `\(i, j\)` gains `(.*?)`', answer)
    diagonal = stated_formula(r"The diagonal's score gains `(.*?)` to first order in `dt`", answer)
    h = hamiltonian('leapfrog', nh=1)
    F_ = lambda x: h.force(x.view(1, 1, -1)).flatten()  # noqa: E731  a token's force
    q, k = qk_pair(nh=1)
    left, diagonal_left = [], []
    for dt in (0.02, 0.01):
        q1, k1 = h(q, k, dt=torch.full((1,), dt, dtype=torch.float64))
        change = q1[0, 0] @ k1[0, 0].T - q[0, 0] @ k[0, 0].T
        stated_gain = torch.tensor([[formula(score_gain, dt=dt, q_i=q[0, 0, a], k_i=k[0, 0, a], k_j=k[0, 0, b], F=F_,
                                             q_j=q[0, 0, b]).item() for b in range(5)] for a in range(5)])
        left.append((change - stated_gain.double()).abs().max().item())
        diagonal_left.append(max(abs(change[i, i] - formula(diagonal, dt=dt, k_i=k[0, 0, i], q_i=q[0, 0, i], F=F_))
                                 for i in range(5)))
    assert 3.3 < left[0] / left[1] < 4.7, f"the score of (i, j) gains `{score_gain}` up to O(dt^2): {left}"
    assert 3.3 < diagonal_left[0] / diagonal_left[1] < 4.7, f"the diagonal gains `{diagonal}` up to O(dt^2)"
    # its force term can be negative and outweigh dt |k_i|^2: then the diagonal's score falls (no rule that it rises)
    q, k_small = qk_pair(nh=1, T=40)[0], 0.05 * qk_pair(nh=1, T=40)[1]
    q1, k1 = h(q, k_small, dt=torch.full((1,), 0.05, dtype=torch.float64))
    falls = [i for i in range(40) if formula(diagonal, dt=0.05, k_i=k_small[0, 0, i], q_i=q[0, 0, i], F=F_) < 0
             and q1[0, 0, i] @ k1[0, 0, i] < q[0, 0, i] @ k_small[0, 0, i]]
    assert falls and 'the diagonal\'s score falls. So "the diagonal\'s score rises" is no rule' in answer
    # attention's first-order change: the stated Delta p_ij against the softmax, for a small change of the scores
    change = stated_formula(r'To first order in the score changes, `Delta p_ij = (.*?)`', answer)
    change = change.replace('Delta ', 'Delta_')
    change = re.sub(r'sum_l (\w+)_il (\w+)_il', r'(\1 * \2).sum(-1, keepdim=True)', change)
    g = torch.Generator().manual_seed(4)
    d, S, dS = 16, 3 * torch.randn(6, 6, dtype=torch.float64, generator=g), torch.randn(6, 6, dtype=torch.float64,
                                                                                        generator=g)
    P = (S / math.sqrt(d)).softmax(-1)
    left = []
    for eps in (1e-3, 5e-4):
        stated_change = formula(change, p_ij=P, p=P, Delta_s_ij=eps * dS, Delta_s=eps * dS, d=d, sqrt=math.sqrt)
        left.append(((((S + eps * dS) / math.sqrt(d)).softmax(-1) - P) - stated_change).abs().max().item())
    assert 3.3 < left[0] / left[1] < 4.7, f"`Delta p_ij = {change}` must leave O(Delta s^2): {left}"
    # the diagonal's dt |k_i|^2 beats dt k_i . k_j exactly where the stated signed projection exceeds |k_i|
    projection = stated_formula(r'the signed projection of `k_j` on `k_i`, `(.*?)`, exceeds `\|k_i\|`', answer)
    keys = torch.randn(30, 4, dtype=torch.float64, generator=g)
    for i, j in itertools.product(range(6), range(30)):
        k_i, k_j = keys[i], keys[j]
        assert bool(0.1 * k_i @ k_j > 0.1 * k_i @ k_i) == bool(formula(projection, k_i=k_i, k_j=k_j) > k_i.norm()), \
            f"the signed projection `{projection}`"
    # the lab's copy: its numbers, as exercise 5 prints them, and why the diagonal's score rises in every row there
    _, heads = exercise_5_rows(lab_output(lab, 5))
    rises, of = map(int, re.search(r'it rises in (\d+) of the (\d+) rows of every head', answer).groups())
    assert of == 48 and all(h[2] == rises for h in heads)
    falls = tuple(map(float, re.search(r'Its attention falls in (\d+) to (\d+) of the 48 rows', answer).groups()))
    assert falls == (min(h[3] for h in heads), max(h[3] for h in heads))
    alone, first = re.search(r'`dt k_i . k_j` alone explains R\^2 of ([\d.]+ to [\d.]+) of the score changes, and the '
                             r'whole first-order formula ([\d.]+ to \d\.\d+)', answer).groups()
    for stated_range, column in ((alone, 0), (first, 1)):
        low, high = map(float, stated_range.split(' to '))
        assert (low, high) == (min(h[column] for h in heads), max(h[column] for h in heads)), stated_range
    qk, (q, k, q1, k1) = layer_1_of_the_lab_copy()
    dt = qk.dt.view(-1, 1)
    with torch.no_grad():
        kinetic, force = dt * (k * k).sum(-1), dt * (q * qk.force(q)).sum(-1)  # (n_head, 48) each
    assert 'because there `dt |k_i|^2` outweighs the force term' in answer and (kinetic > -force).all()
    assert ((q1 * k1).sum(-1) > (q * k).sum(-1)).all()  # (and the score itself rises: the 48 of 48 above)


def keeps(step, **claims):  # a step's claims (symplectic, volume_preserving, symmetric, order), measured
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(INTEGRATORS, 'claimed', Integrator(step, forces=0, vector_ops=0, **claims))
        for what in CLAIMS[:-1]:
            torch.manual_seed(0)  # (the measured order moves with the map's random start)
            assert_integrator_keeps('claimed', what)
        return order_ratio('claimed')


def test_lab_answer_6_the_template_passes_its_claims_and_the_steps_keep_their_laws_and_costs(lab):
    # the template appended: `pytest -k mine` passes its claims and its cost (the cost test among them), and exercise
    # 2 takes it as an argument (as exercise 1 does): its row is leapfrog's
    out = lab_output(lab, 'mine')
    claims = [what for what in CLAIMS[:-1] if not re.search(rf'\[mine\S*-{what}\] PASSED', out)]  # each, by name
    assert not claims and 'mine' not in INTEGRATORS, f"no passed test of the claims {claims}: {out[-2000:]}"
    assert 'exercises/test_lab.py::test_lab_each_integrators_declared_cost_is_what_its_step_does[mine] PASSED' in out
    rows = exercise_2_rows(lab_output(lab, 2))
    assert rows['mine', 'float64'] == rows['leapfrog', 'float64']
    answer = lab_section(6, lab_text('ANSWERS.md'))
    # the claims and costs of the steps students pick: drift-kick-drift, Yoshida written three ways, Runge-Kutta
    assert 'Drift-kick-drift is symplectic, symmetric and of order 2, with one force a step' in answer
    assert counted_cost(lab_step('dkd')) == (1, number_in(r'with one force a step and (\d) vector operations', answer))
    keeps(lab_step('dkd'), symplectic=True, volume_preserving=True, symmetric=True, order=2)
    costs = re.search(r'hint card does it costs (\d+) forces and (\d+) vector operations; a student who merges its '
                      r'adjacent half kicks counts (\d+) and (\d+), and one who builds it on drift-kick-drift (\d+) '
                      r'and (\d+)', answer).groups()
    written = (lab_step('yoshida'), yoshida_merged, yoshida_on_dkd)
    assert [counted_cost(step) for step in written] == [tuple(map(int, costs[i:i + 2])) for i in (0, 2, 4)], costs
    for step in written[1:]:  # the same step of order 4, written another way
        keeps(step, symplectic=True, volume_preserving=True, symmetric=True, order=4)
    # Runge-Kutta: its state's error falls 2^4 per halving of dt, so the order test (which measures the state's) takes
    # a claim of 4; its energy's error on exercise 1's pendulum falls the stated factor, faster
    assert 'Runge-Kutta step is of order 4 but neither symplectic nor symmetric' in answer
    falls, claim = re.search(r'measures the state.s error, which falls about (\d+)x per halving of `dt`, so a claim '
                             r'of order (\d) passes', answer).groups()
    ratio = keeps(rk4, symplectic=False, volume_preserving=False, symmetric=False, order=int(claim))
    assert abs(ratio / int(falls) - 1) < 0.1 and int(falls) == 2 ** int(claim), (
        f"answer 6: Runge-Kutta's state error falls about {falls}x per halving of dt, as order {claim} says; the order "
        f"test measures {ratio:.1f}x")
    factor = number_in(r'its energy error on the pendulum falls about (\d+)x per halving', answer)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(INTEGRATORS, 'rk4', Integrator(rk4, False, False, False, order=4, forces=4, vector_ops=26))
        energy = pendulum_energy_error('rk4', 0.1) / pendulum_energy_error('rk4', 0.05)
        # the order law: errors 2^p times smaller as dt halves, for p = 1 (Euler), 2 (leapfrog) and 4 (Runge-Kutta)
        law = stated_formula(r'errors `(.*?)` times smaller as `dt` halves', answer)
        for name in ('euler', 'leapfrog', 'rk4'):
            p, ratio = INTEGRATORS[name].order, order_ratio(name)
            assert abs(ratio / formula(law, p=p) - 1) < 0.15, (
                f"answer 6's errors `{law}` times smaller as dt halves: for {name} (p = {p}) that is "
                f"{formula(law, p=p)}; the error falls {ratio:.2f}x")
    assert abs(energy / factor - 1) < 0.05 and energy > 1.4 * 2 ** 4, (  # faster than the order says
        f"answer 6: Runge-Kutta's energy error on exercise 1's pendulum falls about {factor:g}x from dt = 0.1 to 0.05, "
        f"faster than 2^4; it falls {energy:.1f}x")
    percent = re.search(r"at `dt = 0.1` Euler's scores differ from leapfrog's by (\d+)% of their change", answer)
    assert percent and f"`O(dt^2)`: {percent.group(1)}% of the change at `dt = 0.1`" in lab_section(
        3, lab_text('ANSWERS.md')) and 'three seeds cannot tell' in answer


def rk4(h, q, k, dt):  # the classical fourth-order Runge-Kutta step of q' = k, k' = F(q): 4 forces, 26 vector ops
    k1q, k1k = k, h.force(q)
    k2q, k2k = k + dt / 2 * k1k, h.force(q + dt / 2 * k1q)
    k3q, k3k = k + dt / 2 * k2k, h.force(q + dt / 2 * k2q)
    k4q, k4k = k + dt * k3k, h.force(q + dt * k3q)
    return q + dt / 6 * (k1q + 2 * k2q + 2 * k3q + k4q), k + dt / 6 * (k1k + 2 * k2k + 2 * k3k + k4k)


W1 = 1 / (2 - 2 ** (1 / 3))  # Yoshida's weights
W0 = 1 - 2 * W1


def yoshida_merged(h, q, k, dt):  # Yoshida with its adjacent half kicks merged: 4 forces, 10 vector ops
    k = k + h.force(q, W1 * dt / 2)
    for drift, kick in ((W1, (W1 + W0) / 2), (W0, (W0 + W1) / 2), (W1, W1 / 2)):
        q = q + drift * dt * k
        k = k + h.force(q, kick * dt)
    return q, k


def yoshida_on_dkd(h, q, k, dt):  # Yoshida built on drift-kick-drift: 3 forces, 15 vector ops
    for w in (W1, W0, W1):
        q = q + w * dt / 2 * k
        k = k + h.force(q, w * dt)
        q = q + w * dt / 2 * k
    return q, k


@torch.no_grad()
def order_ratio(name):
    """How much smaller the state's error gets as dt halves, for INTEGRATORS[name] (seeded): at time 1 after n steps
    of dt = 1/n, against 1024 steps', from n = 8 to 16."""
    torch.manual_seed(0)
    one_head(Hamiltonian(1, 4, 8, 2, name))  # drawn first, as when the lab's factors were measured: the same map next
    (q, k), qk, ends = qk_pair(B=1, nh=1, T=3, hs=4, seed=7), one_head(Hamiltonian(1, 4, 8, 1, name)), {}
    for n in (1024, 16, 8):
        ends[n] = (q, k)
        with step_size(qk, 1 / (n * qk.dt[0].item())):
            for _ in range(n):
                ends[n] = qk(*ends[n])
    error = lambda n: max((a - b).abs().max().item() for a, b in zip(ends[n], ends[1024]))  # noqa: E731
    return error(8) / error(16)


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


def test_lab_exercise_6_and_the_hint_card_state_each_steps_counted_cost():
    # exercise 6 gives drift-kick-drift's cost, and the homework's hint card each candidate's: forces and vector
    # operations, as the tests' reference steps count them
    worksheet = lab_text('WORKSHEET.md')
    given = re.search(r'set `forces=(\d+), vector_ops=(\d+)`', lab_section(6, worksheet)).groups()
    assert tuple(map(int, given)) == counted_cost(lab_step('dkd')), f"exercise 6 gives drift-kick-drift's cost {given}"
    halving = {}  # "`dt * k / 2` costs one operation more" than `dt / 2 * k`, at each drift
    exec(DKD_STEP.replace('dt / 2 * k', 'dt * k / 2'), halving)
    assert 'drift written `q + dt / 2 * k`; `dt * k / 2` costs one operation more' in lab_section(6, worksheet)
    assert counted_cost(halving['dkd']) == (1, counted_cost(lab_step('dkd'))[1] + 2)
    homework = lab_section('Homework', worksheet)
    how, card = homework.split('**The hint card')
    rows = {name: (int(forces), int(ops)) for name, forces, ops in
            re.findall(r'\| ([^|]+?) \| [^|]+ \| (\d+) \| (\d+) \|', card)}
    names = {'`leapfrog` (the template)': 'leapfrog', 'drift-kick-drift': 'dkd', "Yoshida's fourth order": 'yoshida',
             'classical Runge-Kutta': 'rk4'}
    assert set(rows) == set(names), rows
    for text, name in names.items():
        assert rows[text] == counted_cost(lab_step(name)), f"the hint card's {text} costs {rows[text]}"
    leapfrog = (INTEGRATORS['leapfrog'].forces, INTEGRATORS['leapfrog'].vector_ops)  # the example of a count
    assert rows['`leapfrog` (the template)'] == leapfrog and 'costs 2 forces and 4 vector operations' in how
    # a drift-kick-drift declared with 4 vector ops fails the exact check
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
    for z in (1e-2, 5e-3):  # silu(z) = z/2 + z^2/4 + O(z^4) (silu' near 0: the pre-read's test, answer 4's)
        assert abs((F.silu(torch.tensor(z, dtype=torch.float64)).item() - z / 2) / z ** 2 - 1 / 4) < 0.01
    # measured: the free force's nonlinear part grows 8x per doubling of the spread, the potential's force's 16x
    hs, m = 4, 8
    spreads = (1 / 64, 1 / 32, 1 / 16)
    assert torch.equal(free_force(hs, m, 0.5).a, 0.5 * free_force(hs, m, 1.0).a)  # A scales with W at init
    free = [nonlinear_part(free_force(hs, m, s), hs) for s in spreads]
    potential = [nonlinear_part(torch.manual_seed(0) and FORCES['potential'](1, hs, m, w_std=s).double(), hs)
                 for s in spreads]
    assert all(abs(b / a / 8 - 1) < 0.05 for a, b in zip(free, free[1:])), free  # spread^3
    assert all(abs(b / a / 16 - 1) < 0.05 for a, b in zip(potential, potential[1:])), potential  # spread^4
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


def test_G4_lab_scripts_refuse_bad_input_in_one_line(tmp_path):
    # bad arguments, unfit runs and the template misused: one line naming what to do, never a traceback
    def checkpoint(folder, iter_num=2000, **changes):
        config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=257, block_size=64, attn='coupled')
        config = dataclasses.replace(config, **changes)
        os.makedirs(tmp_path / folder)
        torch.save(dict(model_args=dataclasses.asdict(config), model=GPT(config, verbose=False).state_dict(),
                        config=dict(dataset='pydocs', max_iters=2000), iter_num=iter_num),
                   tmp_path / folder / 'ckpt.pt')
    checkpoint('standard', attn='standard')
    checkpoint('midrun', iter_num=800, attn='standard')
    twice = repository(tmp_path, mine=2)  # the template appended twice
    ex5, ex6 = os.path.join(LAB, 'ex5_learned.py'), os.path.join(LAB, 'ex6_train.py')
    cases = [((os.path.join(LAB, 'ex1_pendulum.py'), 'bogus'), 'cat exercises/ex6_mine.py >> model.py'),
             ((os.path.join(LAB, 'ex2_jacobian.py'), 'leapfrog', 'bogus'), 'cat exercises/ex6_mine.py >> model.py'),
             ((os.path.join(LAB, 'ex3_scores.py'), 'now'), 'ex3_scores.py takes no arguments'),
             ((os.path.join(LAB, 'ex4_linear_regime.py'), '--fast'), 'ex4_linear_regime.py takes no arguments'),
             ((ex5, 'standard'), 'python train.py --attn=coupled'), ((ex5, 'standard/ckpt.pt'), 'attn=standard run'),
             ((ex6, 'bogus'), '--attn=bogus is unknown'),
             ((ex6, 'mine'), 'append the template first: cat exercises/ex6_mine.py'),
             ((ex6, '--seeds', 'one'), "argument --seeds: invalid int value: 'one'"),
             ((ex6, 'coupled', '--', '--seed=7'), '--seed after -- would train another run than its folder names'),
             ((os.path.join(LAB, 'ex6_mine.py'),), 'is a template, not a script: append it to model.py with `cat '
                                                  'exercises/ex6_mine.py >> model.py`'),
             ((twice / 'exercises' / 'ex1_pendulum.py',), 'model.py holds exercises/ex6_mine.py twice; delete the '
                                                          'second copy'),
             ((twice / 'exercises' / 'ex6_train.py',), 'model.py holds exercises/ex6_mine.py twice'),
             ((twice / 'train.py',), 'model.py holds exercises/ex6_mine.py twice')]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: run(*case[0], cwd=tmp_path), cases))
        helps = list(pool.map(lambda s: run(os.path.join(LAB, s), '--help', cwd=tmp_path), (
            'ex1_pendulum.py', 'ex2_jacobian.py', 'ex3_scores.py', 'ex4_linear_regime.py', 'ex5_learned.py')))
        midrun, launcher = run(ex5, 'midrun', cwd=tmp_path), run(ex6, '--help', cwd=tmp_path)
    for (argv, words), r in zip(cases, results):
        assert one_line_error(r, words), (argv[1:], r.stderr[-2000:])
    for n, r in enumerate(helps, 1):  # --help: the docstring, and nothing run
        assert r.returncode == 0 and r.stdout.startswith(f'Exercise {n}.') and r.stderr == '', (n, r.stderr[-2000:])
    doc = re.match(r'"""(.*?)"""', lab_text('ex6_train.py'), re.S).group(1)  # the launcher's --help: all of it
    assert launcher.returncode == 0 and doc in launcher.stdout, launcher.stdout
    # a checkpoint of a run still training: said, with its iteration (then refused here: a standard run)
    assert midrun.stdout.startswith('midrun/ckpt.pt: iteration 800 of 2000, not a finished run'), midrun.stdout


# ---------------------------------------------------------------------------------------------------------------
# exercise 6's launcher: it never deletes or replaces a run

def stub(repo, end='final', code=0, ckpt=True, edit=False):
    """A stub train.py (a run: its folder, a checkpoint unless not ckpt, a log that starts, with the hash of the
    model.py it reads as train.py's does, and ends with `end`, its calls counted, its exit code `code`; with edit, it
    appends a line to model.py before it reads it; one setting, learning_rate) and a stub results/report.py that says what it
    was given."""
    open(repo / 'train.py', 'w').write(
        "import hashlib, json, os, sys\n"
        "learning_rate = 0.002  # one setting, as train.py writes its defaults\n"
        "out = [a for a in sys.argv if a.startswith('--out_dir=')][0][10:]\n"
        f"{edit} and open('model.py', 'a').write('\\n# edited while the launcher runs\\n')\n"
        f"os.makedirs(out, exist_ok=True); {ckpt} and open(os.path.join(out, 'ckpt.pt'), 'a').write('x')\n"
        "open('calls', 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "start = dict(event='start', model_sha256=hashlib.sha256(open('model.py', 'rb').read()).hexdigest())\n"
        "with open(os.path.join(out, 'metrics.jsonl'), 'a') as f:\n"
        f"    f.write(json.dumps(start) + '\\n' + ({end!r} != 'start') * (json.dumps(dict(event={end!r})) + '\\n'))\n"
        f"print('error: the data is not there; run prepare_data.py' if {code} == 1 else 'ok')\n"
        f"sys.exit({code})\n")
    open(repo / 'results' / 'report.py', 'w').write("def main(folders):\n    print('REPORT', *folders)\n")


def checkpoints(repo):  # every run's checkpoint under runs/, by its path: its bytes' hash
    return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest() for p in (repo / 'runs').rglob(
        'ckpt.pt')}


NOT_OURS = "holds a run this launcher did not start, or one of a model.py edited as it started; left alone"


def test_lab_exercise_6_launcher_never_deletes_a_run_resumes_one_cut_short_and_tabulates(tmp_path):
    repo = repository(tmp_path)
    stub(repo)
    launch = lambda *argv: run(repo / 'exercises' / 'ex6_train.py', *argv, cwd=repo)  # noqa: E731
    calls = lambda: open(repo / 'calls').read().splitlines()  # noqa: E731
    r = launch('mine', 'coupled', '--seeds', '1')
    done = re.findall(r'(runs/lab/\w{8}/(?:mine|coupled)-s1): done', r.stdout)
    assert r.returncode == 0 and len(done) == 2 and len(calls()) == 2, r
    assert f"REPORT {' '.join(done)}" in r.stdout and f"python results/report.py {' '.join(done)}" in r.stdout, r.stdout
    first = checkpoints(repo)
    r = launch('mine', 'coupled', '--seeds', '1')  # the same step and flags: kept, not trained again
    assert r.stdout.count('trained already with this step and these flags, kept') == 2 and len(calls()) == 2, r
    r = launch('mine', 'coupled', '--seeds', '1', '--', '--learning_rate=2e-3')  # at train.py's default: the same
    assert r.stdout.count('trained already with this step and these flags, kept') == 2 and len(calls()) == 2, r
    # other flags: new runs in new folders (the report's labels stay mine, coupled); the first runs untouched
    r = launch('mine', 'coupled', '--seeds', '1', '--', '--dataset=other')
    again = re.findall(r'(runs/lab/\w{8}/(?:mine|coupled)-s1): done', r.stdout)
    assert len(again) == 2 and not set(again) & set(done) and len(calls()) == 4, r.stdout
    # mine edited: mine trains again in a new folder, coupled (model.py before the template) is kept
    open(repo / 'model.py', 'a').write('\n# mine, edited\n')
    r = launch('mine', 'coupled', '--seeds', '1')
    assert 'coupled-s1: trained already' in r.stdout and re.search(r'/mine-s1: done', r.stdout), r.stdout
    assert len(calls()) == 5 and {k: v for k, v in checkpoints(repo).items() if k in first} == first
    # a run the launcher did not start, where it would train one: left alone, named, and the exit is 1
    foreign = repo / os.path.dirname(done[1]) / 'coupled-s2'
    os.makedirs(foreign), (foreign / 'ckpt.pt').write_text('a run trained by hand')
    r = launch('coupled', '--seeds', '2')
    assert r.returncode == 1 and f"{foreign.relative_to(repo)}: {NOT_OURS}" in r.stdout and \
        (foreign / 'ckpt.pt').read_text() == 'a run trained by hand' and len(calls()) == 5, r
    assert r.stderr.strip() == 'error: 1 of 1 runs are not in the table (their lines above say why)'
    # a run cut short (Ctrl-C: a checkpoint, no final) resumes; a diverged one is a result; a failure names its line
    stub(repo, end='start', code=130)
    r = launch('coupled', '--seeds', '3')
    assert r.returncode == 1 and 'coupled-s3: stopped (exit 130)' in r.stdout, r
    stub(repo)
    r = launch('coupled', '--seeds', '3')
    assert 'coupled-s3: resumed, done' in r.stdout and calls()[-1].endswith('--init_from=resume'), r.stdout
    stub(repo, end='diverged', code=1)
    r = launch('coupled', '--seeds', '4')
    assert r.returncode == 0 and 'coupled-s4: diverged; the table counts it' in r.stdout, r
    assert 'coupled-s4: trained already with this step and these flags, kept (it diverged)' in launch(
        'coupled', '--seeds', '4').stdout
    stub(repo, end='start', code=1, ckpt=False)
    r = launch('coupled', '--seeds', '5')
    assert r.returncode == 1 and 'coupled-s5: stopped (exit 1): error: the data is not there; run prepare_data.py' \
        in r.stdout, r
    assert {k: v for k, v in checkpoints(repo).items() if k in first} == first  # nothing of the first runs changed


def test_G4_lab_pytest_with_the_template_appended_twice_ends_in_its_one_line(tmp_path):
    repo = repository(tmp_path, mine=2)  # `cat exercises/ex6_mine.py >> model.py`, twice
    r = run('-m', 'pytest', '-q', '-p', 'no:cacheprovider', cwd=repo, env={'PYTHONDONTWRITEBYTECODE': '1'})
    assert r.returncode == 2 and (r.stdout + r.stderr).strip() == "Exit: error: model.py holds exercises/ex6_mine.py " \
        "twice; delete the second copy from the end of model.py, or start again with `git checkout model.py`", r


def test_lab_exercise_6_launcher_stops_when_model_py_changes_under_it(tmp_path):
    # each stub run edits model.py before it reads it, as an edit between the launcher's check and train.py's import
    # does: those runs are not filed under the hash of the model.py the launcher read, and no other run starts (two
    # at a time: seed 3 starts after seed 1 or 2 edited it)
    repo, launch = repository(tmp_path), lambda *seeds: run(  # noqa: E731
        repo / 'exercises' / 'ex6_train.py', 'mine', '--seeds', *seeds, cwd=repo)
    read = (repo / 'model.py').read_bytes()
    stub(repo, edit=True)
    r = launch('1', '2', '3')
    trained = open(repo / 'calls').read()
    assert r.returncode == 1 and '--seed=1 ' in trained and '--seed=3 ' not in trained, (r, trained)
    assert r.stdout.count("so it is not filed as this one's; left alone") == trained.count('--seed=') and \
        'done' not in r.stdout, r.stdout
    assert "mine-s3: not started, as model.py changed while this launcher ran" in r.stdout and \
        r.stderr == 'error: 3 of 3 runs are not in the table (their lines above say why)\n', (r.stdout, r.stderr)
    # model.py as the launcher read it again: seed 1's folder holds the edited code's run, left alone, not used
    (repo / 'model.py').write_bytes(read)
    stub(repo)
    r = launch('1')
    assert r.returncode == 1 and f"mine-s1: {NOT_OURS}" in r.stdout and open(repo / 'calls').read() == trained, r


def test_lab_exercise_6_launcher_trains_the_template_and_prints_the_report(lab):
    first, second, repo = lab['launcher']
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    out = re.search(r'(runs/lab/\w{8}/mine-s1): done', first.stdout)
    assert out and (repo / out.group(1) / 'ckpt.pt').exists(), first.stdout
    assert '| pydocs | mine | 1 |' in first.stdout and '| pydocs | mine | 1 |' in second.stdout  # report.py's table
    assert f"{out.group(1)}: trained already with this step and these flags, kept" in second.stdout
