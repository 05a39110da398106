"""The results pages' tables (results/tables.py, over bench.py's report) on hand-made logs: what each table reads,
and the logs that once bent it (a diverged seed, a copy of a run, a layer missing, a setting logged as a string,
a sweep over a key of any type, seeds that all ended alike)."""
import importlib.util
import json
import math
import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tables  # noqa: E402


def log_records(folder, *records):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'metrics.jsonl'), 'a') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)


def fake_run(folder, evals, final_ppl, attn_last=None, nonlinear=None, diverged_at=None, losses=(), **config):
    """A run's metrics.jsonl: a start, a train-loss point per iteration (losses), evals [(tokens, val_loss)] at 128
    tokens an iteration (the last with the attention diagnostics attn_last and the q/k map's nonlinear fraction, if
    given), then a final of perplexity final_ppl or, with diverged_at, the 'diverged' record train.py writes."""
    cfg = dict(dataset='pydocs', attn='standard', n_layer=2, n_head=4, n_embd=128, block_size=32, bias=False,
               pos='learned', batch_size=4, gradient_accumulation_steps=1, eval_iters=2, learning_rate=1e-3,
               max_iters=evals[-1][0] // 128, warmup_iters=2, seed=1) | config
    records = [dict(event='eval', iter=t // 128, tokens=t, val_loss=loss,
                    qk=[] if nonlinear is None else [dict(nonlinear=nonlinear)] * 2) for t, loss in evals]
    if attn_last is not None:
        records[-1]['attn'] = attn_last
    train = [dict(event='train', iter=i, loss=x, tokens=128 * i) for i, x in enumerate(losses, 1)]
    last = max(evals[-1][0] // 128, len(losses))
    end = (dict(event='diverged', iter=diverged_at) if diverged_at else
           dict(event='final', iter=last, tokens=evals[-1][0], val_loss=math.log(final_ppl), val_ppl=final_ppl))
    log_records(folder, dict(event='start', iter=0, config=cfg, world_size=1, tokens=0),
                *sorted(records + train, key=lambda r: r['iter']), end)  # in the order of their iterations


def layers(*xs):
    return [dict(entropy=e, sink=s, gap=g) for e, s, g in xs]


def report(capsys, *args):
    """python results/tables.py ARGS in this process: (exit code, stdout, stderr)."""
    try:
        tables.main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit('error: ...'): Python prints the line and exits with 1
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    out = capsys.readouterr()
    return code, out.out, out.err


def table(stdout, title=None):  # {variant: cells} of the results table, or of the table after `title`
    text = stdout.split(title)[1].split('\n\n')[0] if title else stdout.split('\n\n')[0]
    return {line.split(' | ')[1]: [c.strip() for c in line.split('|')[1:-1]] for line in text.splitlines()
            if line.startswith('| pydocs')}


CURVE = [(0, 5.0), (128, 3.0), (256, 2.5)]
ATT = layers((0.9, 0.1, 0.5), (0.7, 0.3, 0.4))


def test_attention_per_layer_mean_over_seeds_and_older_logs_as_before(tmp_path, capsys):
    runs = tmp_path / 'runs'
    fake_run(runs / 'standard-s1', CURVE, 8.0, attn_last=ATT)
    fake_run(runs / 'standard-s2', CURVE, 8.0, seed=2, attn_last=layers((0.8, 0.2, 0.6), (0.5, 0.5, 0.2)))
    fake_run(runs / 'coupled-s1', CURVE, 9.0, attn='coupled')  # an older log: no diagnostics
    code, out, err = report(capsys, runs)
    assert code == 0 and err == '', err
    assert set(table(out)) == {'standard', 'coupled'}
    assert table(out, 'Attention') == {'standard': [  # per layer, mean over the seeds; the layers' mean, per seed
        'pydocs', 'standard', '2', '0.850 0.600 (0.725 +- 0.106)', '0.150 0.400 (0.275 +- 0.106)',
        '0.550 0.300 (0.425 +- 0.035)']}
    code, old, err = report(capsys, runs / 'coupled-s1')
    assert code == 0 and 'Attention' not in old and '| pydocs | coupled | 1 |' in old


def test_a_diverged_seed_is_counted_and_never_averaged(tmp_path, capsys):
    runs = tmp_path / 'runs'
    for s in range(1, 6):
        fake_run(runs / f'standard-s{s}', CURVE, 10.0 + 0.1 * s, seed=s, attn_last=ATT, nonlinear=0.0)
        fake_run(runs / f'coupled-s{s}', [(0, 5.0), (128, 3.0), (256, 2.6)], 10.0 + 0.1 * s, attn='coupled', seed=s,
                 attn_last=ATT, nonlinear=0.04)
    code, out, err = report(capsys, runs)
    assert code == 0, err
    clean, clean_att = table(out), table(out, 'Attention')
    # a sixth seed that diverged at iteration 3: its iteration-2 estimate, nonlinear and attention are no final's
    fake_run(runs / 'coupled-s6', [(0, 5.0), (128, 3.0), (256, 2.0)], None, attn='coupled', seed=6, diverged_at=3,
             attn_last=layers((0.1, 0.9, 0.1), (0.1, 0.9, 0.1)), nonlinear=0.01, max_iters=2)
    # a row whose every seed diverged at iteration 2: no step 0 figures, no "0.00x"
    fake_run(runs / 'early-s1', [(0, 5.0)], None, attn='coupled', diverged_at=2, attn_last=ATT, nonlinear=0.01,
             max_iters=40)
    code, out, err = report(capsys, runs)
    rows, att = table(out), table(out, 'Attention')
    assert code == 0 and rows['coupled'][3] == clean['coupled'][3] + ' (1 of 6 diverged)', out
    assert rows['coupled'][5:7] == clean['coupled'][5:7] == ['0.90x', '4.00%']  # tokens to match, nonlinear
    assert att['coupled'] == clean_att['coupled'] and 'early' not in att
    assert rows['early'][2:7] == ['1', 'inf (1 of 1 diverged)', '-', '-', '-']


def test_each_run_is_counted_once_by_content(tmp_path, capsys):
    runs = tmp_path / 'runs'
    for s in (1, 2):
        fake_run(runs / f'coupled-s{s}', CURVE, 8.0 + s, attn='coupled', seed=s, attn_last=ATT, nonlinear=0.02 * s)
    code, clean, err = report(capsys, runs)
    os.makedirs(runs / 'coupled-s3')
    os.link(runs / 'coupled-s1' / 'metrics.jsonl', runs / 'coupled-s3' / 'metrics.jsonl')  # a hard link
    shutil.copytree(runs / 'coupled-s2', runs / 'coupled-s4')  # cp -r
    code, out, err = report(capsys, runs)
    assert code == 0 and out == clean, out
    assert 'are one file (a link); counted once' in err and 'are copies of one log; counted once' in err
    assert table(out)['coupled'][2] == table(out, 'Attention')['coupled'][2] == '2'
    # the lab launcher's retraining of a run, beside it: not a run of its own until it takes the run's place
    fake_run(runs / 'coupled-s1.new', CURVE, 5.0, attn='coupled', learning_rate=3e-3)
    code, out, err = report(capsys, runs)
    assert code == 0 and out == clean and 'coupled-s1.new is the retraining of ' in err, err


def test_a_layer_table_only_from_seeds_with_every_layer_and_finite_diagnostics(tmp_path, capsys):
    runs = tmp_path / 'runs'
    fake_run(runs / 'standard-s1', CURVE, 8.0, attn_last=ATT)
    fake_run(runs / 'standard-s2', CURVE, 8.0, seed=2, attn_last=ATT[1:])  # its first layer's entry lost
    fake_run(runs / 'standard-s3', CURVE, 8.0, seed=3,
             attn_last=layers((math.nan, 0.1, 0.5), (0.7, 0.3, 0.4)))  # one layer's entropy NaN
    code, out, err = report(capsys, runs)
    assert code == 0 and table(out, 'Attention')['standard'][2:4] == ['1', '0.900 0.700 (0.800)'], out
    assert 'diverged' not in out and 'standard-s2/metrics.jsonl: its final attention diagnostics logged 1 of 2 ' \
        'layers; left out of the attention table' in err and 'standard-s3/metrics.jsonl: its final attention ' \
        'diagnostics are not all finite' in err
    # the q/k diagnostics too: a seed whose final eval lost a layer's is out of the nonlinear column, said so
    fake_run(runs / 'coupled-s1', CURVE, 8.0, attn='coupled', nonlinear=0.02)
    fake_run(runs / 'coupled-s2', CURVE, 8.0, attn='coupled', seed=2, nonlinear=0.06)
    log = runs / 'coupled-s2' / 'metrics.jsonl'
    records = [json.loads(line) for line in log.read_text().splitlines()]
    next(r for r in reversed(records) if r['event'] == 'eval')['qk'] = [dict(nonlinear=0.5)]  # 1 of 2 layers
    log.write_text(''.join(json.dumps(r) + '\n' for r in records))
    code, out, err = report(capsys, runs)
    assert code == 0 and table(out)['coupled'][6] == '2.00%', out  # seed 1's alone, not (2% + 50%) / 2
    assert 'coupled-s2/metrics.jsonl: its final q/k diagnostics logged 1 of 2 layers; left out of the nonlinear ' \
        'and dt columns' in err, err


def test_every_setting_is_typed_and_a_key_an_older_log_lacks_leaves_it_out_of_that_table_only(tmp_path, capsys):
    runs = tmp_path / 'runs'
    fake_run(runs / 'standard-s1', CURVE, 8.0, learning_rate='0.002', warmup_iters='1', losses=[5, 4, 4.5])
    fake_run(runs / 'standard-s2', CURVE, 9.0, seed=2, learning_rate=2e-3, warmup_iters=1, losses=[5, 4, 4.5])
    fake_run(runs / 'coupled-s1', CURVE, None, attn='coupled', max_iters='40', diverged_at=3)
    fake_run(runs / 'bad-s1', CURVE, 8.0, max_iters='forty')  # no number: left out, with a note
    fake_run(runs / 'old-s1', CURVE, 8.0, learning_rate=4e-3)
    lines = (runs / 'old-s1' / 'metrics.jsonl').read_text().splitlines()
    start = json.loads(lines[0])
    del start['config']['pos']  # an older log, from before the flag
    (runs / 'old-s1' / 'metrics.jsonl').write_text('\n'.join([json.dumps(start)] + lines[1:]) + '\n')
    code, out, err = report(capsys, runs, '--sweep=pos')
    assert code == 1 and "error: --sweep=pos: every run has pos=learned; name a setting the runs vary" in err
    code, out, err = report(capsys, runs, '--sweep=learning_rate')
    rows = table(out)
    assert code == 0 and rows['standard'][2:4] == ['2', '8.500 +- 0.707'], out  # "0.002" is 2e-3: one row
    assert '| pydocs | standard | 0.002 | 2 | 8.500 +- 0.707 | 0 | 2 (2) |' in out, out  # 4.5 > 1.1 * 4, at 3
    assert '| pydocs | standard | 0.004 | 1 | 8.000 |' in out  # old-s1: alone at its rate, so on standard's line
    assert rows['coupled'][3] == 'inf (1 of 1 diverged)' and rows['coupled'][8] == '5,120'  # 40 x 128 tokens
    assert 'bad' not in rows and 'bad-s1/metrics.jsonl: a setting among max_iters' in err
    os.makedirs(tmp_path / 'other')  # nothing there yet
    code, out, err = report(capsys, runs, '--sweep=pos', runs / 'standard-s1', runs / 'old-s1', tmp_path / 'other')
    assert code == 1 and 'every run has pos=learned' in err  # old-s1 left out of the sweep, not of the report
    fake_run(tmp_path / 'other' / 'rotary-s1', CURVE, 7.0, pos='rotary')
    code, out, err = report(capsys, runs, tmp_path / 'other', '--sweep=pos')
    assert code == 0 and {c[2] for c in table(out, 'Sweep of').values()} == {'learned', 'rotary'}, out
    assert '1 run did not log pos (older logs), left out of the sweep' in err and 'old' in table(out)


def test_sweep_tabulates_perplexity_diverged_runs_and_spikes_against_a_setting(tmp_path, capsys):
    runs, smooth = tmp_path / 'runs', [5.0, 4.0, 3.0, 2.9, 2.8, 2.7, 2.6, 2.5]
    for a in ('standard', 'coupled'):
        for s in (1, 2):
            fake_run(runs / f'{a}-1e-3-s{s}', CURVE, 8.0 + s, attn=a, seed=s, losses=smooth)
        fake_run(runs / f'{a}-4e-3-s1', CURVE, 7.0, attn=a, learning_rate=4e-3,
                 losses=[5.0, 4.0, 3.0, 2.0, 2.3, 2.1, 2.19, 2.0])
    # standard at 4e-3, seed 2: spikes at 5 (3.0 > 1.1 * 2.0) and 6, then inf; coupled: a spike inside warmup only
    fake_run(runs / 'standard-4e-3-s2', CURVE, None, seed=2, learning_rate=4e-3, diverged_at=7,
             losses=[5.0, 4.0, 3.0, 2.0, 3.0, 2.5])
    fake_run(runs / 'coupled-4e-3-s2', CURVE, 9.0, attn='coupled', seed=2, learning_rate=4e-3,
             losses=[5.0, 9.0] + smooth[2:])
    code, out, err = report(capsys, runs, '--sweep=learning_rate')
    assert code == 0, err
    sweep = [line.split(' | ')[1:] for line in out.split('Sweep of learning_rate')[1].splitlines()
             if line.startswith('| pydocs')]
    assert sweep == [['coupled', '0.001', '2', '9.500 +- 0.707', '0', '0 (0) |'],
                     ['coupled', '0.004', '2', '8.000 +- 1.414', '0', '1 (1) |'],  # 2.3 > 1.1 * 2.0, after warmup
                     ['standard', '0.001', '2', '9.500 +- 0.707', '0', '0 (0) |'],
                     ['standard', '0.004', '2', '7.000', '1', '3 (2) |']]  # 2.3; 3.0 and 2.5 (> 2.2)
    assert table(out)['standard-4e-3'][3] == '7.000 (1 of 2 diverged)'
    code, out, err = report(capsys, runs, '--sweep=learning_rat')
    assert code == 1 and err.strip() == ("error: --sweep=learning_rat: no run logged that setting; name a train.py "
                                         "flag, e.g. learning_rate")
    code, out, err = report(capsys, runs, '--sweep=seed')  # a value per seed, in one row
    assert code == 0 and [c[2:4] for c in table(out, 'Sweep of').values()] != [], out
    assert sorted(line.split(' | ')[2:4] for line in out.split('Sweep of seed')[1].splitlines()
                  if line.startswith('| pydocs | standard')) == [['1', '1'], ['1', '1'], ['2', '1'], ['2', '1']]


def plotted(monkeypatch, capsys, *args):  # the sweep's picture: per panel, its x scale, label (then title) and lines
    pytest.importorskip('matplotlib')
    figures = []
    monkeypatch.setattr(tables.bench, 'save', lambda fig, path: figures.append(fig))
    code, out, err = report(capsys, *args, '--plot=p.png')
    assert code == 0 and len(figures) == 1, err
    return out, [(ax.get_xscale(), f'{ax.get_xlabel()} | {ax.get_title()}',
                  [list(map(float, line.get_xdata())) for line in ax.lines])
                 for ax in figures[0].axes]


def test_sweep_of_any_key_plots_every_tabulated_value_and_refuses_a_key_no_run_varies(tmp_path, capsys,
                                                                                     monkeypatch):
    runs = tmp_path / 'runs'
    for i, (a, p) in enumerate((('standard', 0.0), ('standard', 0.1), ('standard', 0.2), ('coupled', 0.0))):
        fake_run(runs / f'{a}-{p}-s1', CURVE, 8.0 + i, attn=a, dropout=p)
    fake_run(runs / 'coupled-0.1-s1', CURVE, None, attn='coupled', dropout=0.1, diverged_at=2)
    fake_run(runs / 'standard-bias-s1', CURVE, 7.5, dropout=0.0, bias=True)  # set apart by more than the swept key
    out, [(scale, label, lines)] = plotted(monkeypatch, capsys, runs, '--sweep=dropout')
    assert scale == 'linear' and 'linear axis: a value is 0 or below' in label  # 0.0 on the axis
    assert sorted(lines) == [[], [], [0.0], [0.0], [0.0, 0.1, 0.2], [0.1]], lines  # coupled: 0.0, a cross at 0.1
    assert '| pydocs | standard [bias=False] | 0.2 |' in out and '| pydocs | standard [bias=True] | 0.0 |' in out
    out, [(scale, label, lines)] = plotted(monkeypatch, capsys, runs, '--sweep=attn')  # categorical: a position each
    assert sorted(c[2] for c in table(out, 'Sweep of').values()) == ['coupled'] * 2 + ['standard'] * 4
    assert [0.0] in lines and lines.count([1.0]) == 4  # each standard row its own point: they differ in more
    out, [(scale, label, lines)] = plotted(monkeypatch, capsys, runs, '--sweep=bias')
    assert [0.0, 1.0] in lines and lines.count([0.0]) == 3  # standard at dropout 0: False and True; the rest alone
    assert '| pydocs | standard [dropout=0.0] | True | 1 | 7.500 |' in out
    assert 'x along the top, a diverged run' in label  # (the title) coupled's seed at 0.1 diverged
    out, [(scale, label, lines)] = plotted(monkeypatch, capsys, runs / 'standard-bias-s1', runs / 'standard-0.1-s1',
                                           '--sweep=bias')
    assert label.endswith('| pydocs'), label  # no diverged run: no word of crosses
    code, out, err = report(capsys, runs, tmp_path / 'no-such-runs')  # a typo: not a table short of its rows
    assert code == 1 and err.strip().endswith('no-such-runs is not a run folder; name run folders (the --out_dir of '
                                              'train.py), or folders above them'), err
    code, out, err = report(capsys, runs, '--sweep=dataset')
    assert code == 1 and err.strip() == ("error: --sweep=dataset: every run has dataset=pydocs; name a setting the "
                                         "runs vary, e.g. learning_rate")
    code, out, err = report(capsys, runs, '--sweep=')
    assert code == 1 and err.strip().startswith('error: --sweep= names no setting')
    # a q/k setting: the runs without a q/k map (standard) do not read it and stay out of its sweep, with a note
    fake_run(runs / 'coupled-dt2-s1', CURVE, 8.5, attn='coupled', qk_dt=0.2)
    for path in runs.iterdir():
        if 'dt2' not in path.name:
            log = path / 'metrics.jsonl'
            log.write_text(log.read_text().replace('"seed": 1', '"seed": 1, "qk_dt": 0.1'))
    code, out, err = report(capsys, runs, '--sweep=qk_dt')
    assert code == 0 and 'note: 4 runs without a q/k map (which qk_dt sets) left out' in err, err
    cells = table(out, 'Sweep of').values()
    assert {c[1].split(' [')[0] for c in cells} == {'coupled'} and {c[2] for c in cells} == {'0.1', '0.2'}, out


def test_float32_and_bfloat16_runs_are_rows_apart(tmp_path, capsys):
    runs = tmp_path / 'runs'
    fake_run(runs / 'a' / 'coupled-s1', CURVE, 8.0, attn='coupled', dtype='float32')
    fake_run(runs / 'b' / 'coupled-s1', CURVE, 9.0, attn='coupled', dtype='bfloat16')
    code, out, err = report(capsys, runs, '--sweep=dtype')
    assert code == 0 and 'share seed' not in err and 'dtype differ' in err, err
    assert {k: c[3] for k, c in table(out).items()} == {'coupled [dtype=bfloat16]': '9.000',
                                                        'coupled [dtype=float32]': '8.000'}
    assert [c[2:5] for c in table(out, 'Sweep of').values()] != []


def test_variance_ratios_with_their_intervals_and_seeds_that_all_ended_alike(tmp_path, capsys, monkeypatch):
    runs = tmp_path / 'runs'
    for s in range(1, 6):  # 5 seeds: standard spread 2x coupled's (variance 4x); uncoupled: coupled's, shifted
        fake_run(runs / f'standard-s{s}', CURVE, 10.0 + 0.2 * s, seed=s)
        fake_run(runs / f'coupled-s{s}', CURVE, 10.0 + 0.1 * s, attn='coupled', seed=s)
        fake_run(runs / f'uncoupled-s{s}', CURVE, 9.0 + 0.1 * s, attn='uncoupled', seed=s)
    fake_run(runs / 'invertible-s1', CURVE, 9.0, attn='invertible')  # one seed: no variance
    code, out, err = report(capsys, runs)
    cells = [[c.strip() for c in line.split('|')[1:-1]] for line in out.split('Seed variance')[1].splitlines()
             if line.startswith('| pydocs')]
    rows = {(c[1], c[5]): c for c in cells}
    assert code == 0 and {v for v, _ in rows} == {'standard', 'coupled', 'uncoupled'}, out
    assert rows[('standard', '')][3:5] == ['0.316', '0.1000']
    assert rows[('standard', 'coupled')][6] == '4.00' and rows[('uncoupled', 'coupled')][6] == '1.00'
    if importlib.util.find_spec('scipy'):  # F(0.975; 4, 4) = 9.6045 (tables): 4 / 9.6045 .. 4 * 9.6045
        assert rows[('standard', 'coupled')][7] == '0.42 - 38.42' and err == ''
        assert rows[('uncoupled', 'coupled')][8] == '1.00'  # equal spreads: Levene's p is 1
    with monkeypatch.context() as m:
        m.setitem(sys.modules, 'scipy', None)  # not installed: the ratio, and how to get the rest
        code, out, err = report(capsys, runs)
    assert code == 0 and '| coupled | 4.00 | - | - |' in out and 'need scipy (pip install scipy)' in err
    for s in range(1, 6):  # five seeds that all ended at one perplexity: variance 0, no ratio over it
        fake_run(runs / f'same-s{s}', CURVE, 10.0, attn='same', seed=s)
    code, out, err = report(capsys, runs)
    assert code == 0 and '| pydocs | same | 5 | 0.000 | 0.0000 |' in out and '| same | - | - | - |' in out, err
    assert 'pydocs/same: its seeds\' perplexities are all equal (variance 0); no ratio over it' in err
    for s in range(1, 6):  # finite, yet its square overflows a float (a loss near 700 nats): inf, no traceback
        fake_run(runs / f'huge-s{s}', CURVE, 1e300 if s < 3 else 1.0 + s, attn='huge', seed=s)
    code, out, err = report(capsys, runs)
    assert code == 0 and '| pydocs | huge | 5 | 5.48e+299 | inf |' in out and '| huge | 0.00 | - | - |' in out, out


def test_tokens_to_match_reads_the_seeds_whose_pair_finished_and_bounds_what_never_reaches(tmp_path, capsys):
    import long
    runs = tmp_path / 'long'
    for s in (1, 2):  # standard-2.4x reaches coupled's 3.0 (seed 1 at 128 tokens; seed 2 never: a bound)
        fake_run(runs / f'standard-2.4x-s{s}', [(0, 5.0), (256, 3.0 if s == 1 else 3.5), (512, 2.0 if s == 1 else
                                                                                        3.2)], 8.0, seed=s)
        fake_run(runs / f'coupled-s{s}', [(0, 5.0), (256, 3.0)], 9.0, attn='coupled', seed=s)
    fake_run(runs / 'coupled-s3', [(0, 5.0), (256, 3.0)], None, attn='coupled', seed=3, diverged_at=1)
    long.tokens_to_match(str(runs))  # seed 3: standard-2.4x missing, coupled diverged
    out = capsys.readouterr().out
    assert out.splitlines() == ['seed 1: 1.00x', 'seed 2: > 2.00x',
                                'seed 3: - (standard-2.4x-s3 and coupled-s3 have not both finished)',
                                "standard tokens to match coupled: > 2.00x (a seed's curve never reaches coupled's "
                                "final estimate)"]


def test_a_section_script_takes_no_arguments_and_starts_no_run_when_given_some(tmp_path):
    from test_model import run  # a fork of this process: torch imported already
    for script, args, code, words in (('long.py', ['--help'], 0, 'Closer to convergence'),
                                      ('long.py', ['now'], 1, 'long.py takes no arguments'),
                                      ('laptop.py', ['--help'], 0, '99 runs'),  # before it prepares the corpora
                                      ('laptop.py', ['-n'], 1, 'laptop.py takes no arguments')):
        r = run(os.path.join(HERE, script), *args, cwd=tmp_path, timeout=120)
        assert r.returncode == code and words in r.stdout + r.stderr and 'training' not in r.stdout, r.stderr
        assert os.listdir(tmp_path) == []  # no runs/ made, here or anywhere
