"""The report of runs (results/report.py) on hand-made logs: what each table reads, and what it promises (G3): a
table never mixes models, corpora or trainings, counts each run once (its copies too), and never averages a failed
run (a loss not finite, or not below a uniform guess). Then the section scripts' command line."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

import report  # (conftest.py puts results/ on the path)
from conftest import run, tabulate  # (the repository's tests: one harness)

HERE = os.path.dirname(os.path.abspath(__file__))


def log_records(folder, *records):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'metrics.jsonl'), 'a') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)


def fake_run(folder, evals, final_ppl, world_size=1, start=None, **config):
    """A run's metrics.jsonl: a start (its fields `start`), a train-loss point per iteration (losses), evals
    [(tokens, val_loss)] at 128 tokens an iteration (the last with the attention diagnostics attn_last and the q/k
    map's nonlinear fraction, if given), then a final of perplexity final_ppl (model_iter: the iteration of the model
    it scored, a best-only checkpoint's), or with diverged_at the 'diverged' record train.py writes, or neither
    (final_ppl None: a run that stopped). Returns its settings."""
    tail = {k: config.pop(k) for k in ('attn_last', 'nonlinear', 'diverged_at', 'losses', 'model_iter') if k in config}
    cfg = dict(dataset='pydocs', attn='standard', n_layer=2, n_head=4, n_embd=128, block_size=32, bias=False,
               pos='learned', batch_size=4, gradient_accumulation_steps=1, eval_iters=2, learning_rate=1e-3,
               max_iters=evals[-1][0] // 128, warmup_iters=2, seed=1, out_dir=str(folder)) | config
    log_records(folder, dict(event='start', iter=0, config=cfg, world_size=world_size, tokens=0) | (start or {}))
    log_tail(folder, evals, final_ppl, **tail)
    return cfg


def log_tail(folder, evals, final_ppl, attn_last=None, nonlinear=None, diverged_at=None, losses=(), model_iter=None):
    records = [dict(event='eval', iter=t // 128, tokens=t, val_loss=loss,
                    qk=[] if nonlinear is None else [dict(nonlinear=nonlinear)] * 2) for t, loss in evals]
    if attn_last is not None:
        records[-1]['attn'] = attn_last
    train = [dict(event='train', iter=i, loss=x, ms=10.0, tokens=128 * i) for i, x in enumerate(losses, 1)]
    last = max(evals[-1][0] // 128, len(losses))
    end = [dict(event='diverged', iter=diverged_at)] if diverged_at else [] if final_ppl is None else [
        dict(event='final', iter=last, tokens=evals[-1][0], val_loss=math.log(final_ppl), val_ppl=final_ppl)
        | ({} if model_iter is None else dict(model_iter=model_iter, model_tokens=model_iter * 128))]
    log_records(folder, *sorted(records + train, key=lambda r: r['iter']), *end)  # in the order of their iterations


def resume_run(folder, cfg, at, evals, final_ppl=None, world_size=1, **changes):
    """Append a resume from the checkpoint at iteration `at`: train.py appends a start record, then what it trains;
    changes: flags given at the resume."""
    log_records(folder, dict(event='start', iter=at, config=cfg | changes, world_size=world_size, tokens=at * 128))
    log_tail(folder, evals, final_ppl)


def layers(*xs):
    return [dict(entropy=e, sink=s, gap=g) for e, s, g in xs]


def table(stdout, title=None):  # {variant: cells} of the results table, or of the table after `title`
    text = stdout.split(title)[1].split('\n\n')[0] if title else stdout.split('\n\n')[0]
    return {line.split(' | ')[1]: [c.strip() for c in line.split('|')[1:-1]] for line in text.splitlines()
            if line.startswith('| pydocs')}


CURVE = [(0, 5.0), (128, 3.0), (256, 2.5)]
ATT = layers((0.9, 0.1, 0.5), (0.7, 0.3, 0.4))


def test_the_tokens_standard_needs_are_read_off_its_curves(tmp_path, capsys):
    curve = [(0, 5.0), (128, 4.0), (256, 3.0), (384, 2.5), (512, 2.0)]
    for s in (1, 2):  # standard: two seeds whose mean is the curve above
        fake_run(tmp_path / f'standard-s{s}', [(t, v + (0.1 if s == 1 else -0.1)) for t, v in curve], 8.0, seed=s)
    fake_run(tmp_path / 'standard-2.4x-s1', [(int(t * 2.4) // 128 * 128, v - 0.4) for t, v in curve], 7.0,
             max_iters=9)  # a longer standard run: its curve reaches further
    fake_run(tmp_path / 'coupled-s1', [(0, 5.0), (256, 3.2), (512, 2.9)], 9.0, attn='coupled')
    fake_run(tmp_path / 'uncoupled-s1', [(0, 5.0), (256, 3.0), (512, 1.0)], 6.0, attn='uncoupled')
    fake_run(tmp_path / 'euler-s1', [(0, 5.0), (512, 2.9)], 9.0, attn='euler', learning_rate=3e-3)
    code, out, err = tabulate(capsys, tmp_path)
    rows = table(out)
    # read off the longest standard run, standard-2.4x: (0, 4.6), (256, 3.6), (512, 2.6), (896, 2.1), (1152, 1.6)
    assert code == 0 and rows['coupled'][5] == '0.85x', out  # 2.9: 0.7 of the way from 256 to 512: 435.2, / 512
    assert rows['standard'][5] == '1.85x'  # 2.0 (mean of 2.1, 1.9): 947.2 tokens; a long run's mid-run points
    assert rows['uncoupled'][5] == '> 2.25x'  # 1.0: never, the curve ends at 1152 tokens
    assert rows['standard-2.4x'][4] == '-12.5% at 2.25x its tokens'  # other tokens: said
    assert 'reads the curve of standard-2.4x (1 seed, 5 evals to 1,152 tokens)' in out
    # another training than its baseline's: said (there only)
    assert "note: pydocs/euler: 'vs standard' compares with standard, trained at learning_rate=0.001 (this row: " \
        "0.003)" in err and 'pydocs/coupled: ' not in err, err


def test_G3_never_mixes_models_trainings_or_corpora_and_says_which_model_it_reads(tmp_path, capsys):
    runs, a, b = tmp_path / 'runs', 'a' * 64, 'b' * 64
    fake_run(runs / 'standard-s1', CURVE, 8.0, n_layer=2, start=dict(fingerprint=a))
    fake_run(runs / 'standard-s3', CURVE, 9.0, n_layer=1, seed=3, start=dict(fingerprint=a))  # another model
    fake_run(runs / 'coupled-s1', CURVE, 8.5, attn='coupled', start=dict(fingerprint=a))
    fake_run(runs / 'coupled-s2', CURVE, 9.0, attn='coupled', seed=2, start=dict(fingerprint=b))  # re-prepared
    with open(runs / 'coupled-s1' / 'metrics.jsonl', 'a') as f:
        f.write('{"event": "train", "it')  # a line cut short: a run killed as it wrote
    # best-only: the final scored the checkpoint of iteration 1 of 2; an extension from it stopped
    cfg = fake_run(runs / 'best-s1', [(0, 5.0), (128, 3.0), (256, 3.5)], 7.0, model_iter=1,
                   start=dict(fingerprint=a))
    resume_run(runs / 'best-s1', cfg, 1, [(256, 3.4)], max_iters=9)
    fake_run(runs / 'diff-s1', CURVE, None, attn='diff')  # stopped: no final
    for d, dtype in (('f', 'float32'), ('b', 'bfloat16')):  # another training: rows apart (and no seed shared)
        fake_run(runs / d / 'euler-s1', CURVE, 9.0, attn='euler', dtype=dtype, start=dict(fingerprint=a))
    code, out, err = tabulate(capsys, runs)
    rows = table(out)
    assert code == 0 and set(rows) == {'standard [n_layer=1]', 'standard [n_layer=2]', 'best',
                                       f'coupled [fingerprint={a[:12]}]', f'coupled [fingerprint={b[:12]}]',
                                       'euler [dtype=bfloat16]', 'euler [dtype=float32]'}, out
    assert 'pydocs/euler: its runs are not all alike (dtype differ)' in err and 'share seed' not in err
    assert rows[f'coupled [fingerprint={a[:12]}]'][2:5] == ['1', '8.500', '+6.2%']  # vs standard of its shape, text
    assert rows[f'coupled [fingerprint={b[:12]}]'][2:5] == ['1', '9.000', '-']  # no standard ran on that text
    assert 'pydocs/standard: its runs are not all alike (n_layer differ); shown as 2 rows' in err
    assert 'pydocs/coupled: its runs trained on different texts under the name pydocs' in err
    assert 'coupled-s1/metrics.jsonl:6 is not a log record (cut short?); skipped' in err
    assert "diff-s1/metrics.jsonl is not a finished run" in err
    assert rows['best'][3] == '7.000' and rows['best'][8] == '128'  # the checkpoint's model, at its tokens
    assert "best-s1/metrics.jsonl: its result is its best-only checkpoint's model, iteration 1 of 2" in err


def test_G3_a_run_resumed_with_other_settings_is_a_row_of_its_own(tmp_path, capsys):
    runs = tmp_path / 'runs'
    for s in (1, 2):  # straight runs of 4 and 8 iterations
        fake_run(runs / f'coupled-4-s{s}', [(0, 5.0), (256, 3.5), (512, 3.0)], 9.0 + s, attn='coupled', seed=s)
        fake_run(runs / f'coupled-8-s{s}', [(0, 5.0), (512, 3.0), (1024, 2.5)], 7.0 + s, attn='coupled', seed=s)
    # coupled-4-s3 finished 4 iterations, was resumed with --max_iters=8, and that extension stopped
    cfg = fake_run(runs / 'coupled-4-s3', [(0, 5.0), (256, 3.5), (512, 3.2)], 10.5, attn='coupled', seed=3)
    resume_run(runs / 'coupled-4-s3', cfg, 4, [(512, 3.2), (768, 0.1)], max_iters=8)
    # coupled-8-s3: the same, and the extension finished: its schedule jumped at iteration 4
    cfg = fake_run(runs / 'coupled-8-s3', [(0, 5.0), (256, 3.5), (512, 3.2)], 10.5, attn='coupled', seed=3)
    resume_run(runs / 'coupled-8-s3', cfg, 4, [(512, 3.2), (1024, 2.4)], 7.5, max_iters=8)
    # coupled-8-s4: killed after an eval at 6, past its checkpoint at 5, resumed from 5 (the eval at 6 superseded),
    # killed again, resumed from 6 as 1 process instead of 2: its own row
    cfg = fake_run(runs / 'coupled-8-s4', [(0, 5.0), (640, 2.9), (768, 0.1)], None, attn='coupled', seed=4,
                   max_iters=8, world_size=2)
    resume_run(runs / 'coupled-8-s4', cfg, 5, [(768, 2.8)], world_size=2)
    resume_run(runs / 'coupled-8-s4', cfg, 6, [(1024, 2.6)], 8.6, world_size=1)
    code, out, err = tabulate(capsys, runs)
    rows = table(out)
    assert code == 0 and set(rows) == {'coupled-4', 'coupled-8', 'coupled-8 [resumed: max_iters 4->8]',
                                       'coupled-8 [resumed: world_size 2->1]'}, out
    assert rows['coupled-4'][2:4] == ['3', '10.500 +- 0.500']  # s3: its result at 4 kept
    assert rows['coupled-8'][2] == '2' and rows['coupled-8 [resumed: max_iters 4->8]'][3] == '7.500'
    assert 'coupled-8-s3/metrics.jsonl: resumed with other settings; a row of its own' in err
    loaded = {os.path.basename(os.path.dirname(r['path'])): r for r in report.load_runs([str(runs)])}
    assert [e['tokens'] for e in loaded['coupled-4-s3']['evals']] == [0, 256, 512]  # none past its final
    assert [(e['tokens'], e['val_loss']) for e in loaded['coupled-8-s4']['evals']] == [
        (0, 5.0), (640, 2.9), (768, 2.8), (1024, 2.6)]  # the records past a checkpoint are gone
    assert loaded['coupled-4-s3']['config']['max_iters'] == 4


def test_G3_each_run_is_counted_once_under_its_own_name_whatever_copies_it(tmp_path, capsys):
    runs = tmp_path / 'runs'
    for s in (1, 2):
        fake_run(runs / f'coupled-s{s}', CURVE, 7.0 + s, attn='coupled', seed=s, attn_last=ATT, nonlinear=0.02 * s)
    # seed 1 again, in a folder named as the README names them (a relative --out_dir): two runs, one seed
    fake_run(runs / 'out-coupled-s1', CURVE, 8.2, attn='coupled', out_dir='out-coupled-s1')
    code, clean, err = tabulate(capsys, runs)
    assert table(clean)['coupled'][2:4] == ['2', '8.550 +- 0.636'] and 'pydocs/coupled: 2 runs share seed 1' in err
    os.makedirs(runs / 'coupled-s3')
    os.link(runs / 'coupled-s1' / 'metrics.jsonl', runs / 'coupled-s3' / 'metrics.jsonl')  # a hard link
    shutil.copytree(runs / 'coupled-s2', runs / 'coupled-s2.bak')  # cp -r: a copy, sorted before the original
    os.symlink(runs / 'coupled-s2', tmp_path / 'latest')  # a run reached twice
    shutil.copytree(runs / 'coupled-s1', runs / 's1')  # cp -a: its times kept, and a shorter name
    shutil.copytree(runs / 'out-coupled-s1', runs / 'bak')
    code, out, err = tabulate(capsys, runs, tmp_path / 'latest')
    assert code == 0 and out == clean, out  # as without the copies
    assert f"{runs / 'coupled-s2.bak' / 'metrics.jsonl'} is a copy of {runs / 'coupled-s2' / 'metrics.jsonl'}; " \
           "counted once, as it" in err
    # the link and cp -a's copies: counted as the folder the run was trained in (its out_dir)
    assert f"{runs / 's1' / 'metrics.jsonl'}, {runs / 'coupled-s3' / 'metrics.jsonl'} are copies of " \
           f"{runs / 'coupled-s1' / 'metrics.jsonl'}" in err, err
    assert f"{runs / 'bak' / 'metrics.jsonl'} is a copy of {runs / 'out-coupled-s1' / 'metrics.jsonl'}" in err, err
    # the README's own folders name no seed (out-standard, out-coupled): a cp -a backup leaves their rows as they were
    readme = tmp_path / 'readme'
    for name in ('out-standard', 'out-coupled'):
        fake_run(readme / name, CURVE, 7.5, attn=name[4:], out_dir=name)
    before = tabulate(capsys, readme)[1]
    for name, backup in (('out-standard', 'old'), ('out-coupled', 'bak')):
        shutil.copytree(readme / name, readme / backup)
    assert tabulate(capsys, readme)[1] == before and set(table(before)) == {'standard', 'coupled'}


def test_G3_a_failed_run_is_counted_never_averaged_nor_drawn_until_resumed_past_it(tmp_path, capsys, monkeypatch):
    runs, vocab = tmp_path / 'runs', dict(vocab_size=257)  # a uniform guess: ln 257 = 5.55 nats
    for s in range(1, 6):
        fake_run(runs / f'standard-s{s}', CURVE, 10.0 + 0.1 * s, seed=s, attn_last=ATT, nonlinear=0.0, start=vocab)
        fake_run(runs / f'coupled-s{s}', [(0, 5.0), (128, 3.0), (256, 2.6)], 10.0 + 0.1 * s, attn='coupled', seed=s,
                 attn_last=ATT, nonlinear=0.04, start=vocab)
    code, out, err = tabulate(capsys, runs)
    clean, clean_att = table(out), table(out, 'Attention')
    # a sixth seed, diverged at iteration 3: its iteration-2 estimate, nonlinear and attention are no final's
    cfg = fake_run(runs / 'coupled-s6', [(0, 5.0), (128, 3.0), (256, 2.0)], None, attn='coupled', seed=6,
                   diverged_at=3, attn_last=layers((0.1, 0.9, 0.1), (0.1, 0.9, 0.1)), nonlinear=0.01, max_iters=2,
                   start=vocab)
    # a seventh that finished at 648.6 nats (--learning_rate=5): finite, yet no better than a uniform guess
    fake_run(runs / 'coupled-s7', [(0, 5.0), (128, 3.0), (256, 648.6)], math.exp(648.6), attn='coupled', seed=7,
             attn_last=ATT, nonlinear=0.5, start=vocab)
    # a row whose every seed diverged at iteration 2: no step 0 figures, no "0.00x"
    fake_run(runs / 'early-s1', [(0, 5.0)], None, attn='coupled', diverged_at=2, attn_last=ATT, nonlinear=0.01,
             max_iters=40, start=vocab)
    code, out, err = tabulate(capsys, runs)
    rows, att = table(out), table(out, 'Attention')
    assert code == 0 and rows['coupled'][3] == clean['coupled'][3] + ' (2 of 7 failed)', out
    assert rows['coupled'][4:7] == clean['coupled'][4:7] == ['+0.0%', '0.90x', '4.00%']  # vs standard, tokens, nonlin
    assert att['coupled'] == clean_att['coupled'] and 'early' not in att
    assert rows['early'][2:7] == ['1', 'inf (1 of 1 failed)', '-', '-', '-']
    # the sixth resumed from its checkpoint at iteration 2, past the divergence: a finished run
    resume_run(runs / 'coupled-s6', cfg, 2, [(256, 2.6)], 10.6)
    assert table(tabulate(capsys, runs)[1])['coupled'][3].endswith(' (1 of 7 failed)')
    # an older log, without the vocabulary: only a loss that is not finite fails
    fake_run(runs / 'old-s1', [(0, 5.0), (256, 648.6)], math.exp(648.6), attn='coupled')
    assert table(tabulate(capsys, runs)[1])['old'][3] == f"{math.exp(648.6):.3f}"
    pytest.importorskip('matplotlib')  # the picture's axes follow the runs that did not fail
    figures = []
    monkeypatch.setattr(report, 'save', lambda fig, path: figures.append(fig))
    tabulate(capsys, runs / 'coupled-s1', runs / 'coupled-s7', runs / 'standard-s1', '--plot=c.png')
    assert figures[0].axes[0].get_ylim()[1] < 200, figures[0].axes[0].get_ylim()


def test_the_attention_table_is_per_layer_mean_over_seeds_and_older_logs_have_none(tmp_path, capsys):
    runs = tmp_path / 'runs'
    fake_run(runs / 'standard-s1', CURVE, 8.0, attn_last=ATT)
    fake_run(runs / 'standard-s2', CURVE, 8.0, seed=2, attn_last=layers((0.8, 0.2, 0.6), (0.5, 0.5, 0.2)))
    fake_run(runs / 'coupled-s1', CURVE, 9.0, attn='coupled')  # an older log: no diagnostics
    code, out, err = tabulate(capsys, runs)
    assert code == 0 and err == '', err
    assert set(table(out)) == {'standard', 'coupled'}
    assert table(out, 'Attention') == {'standard': [  # per layer, mean over the seeds; the layers' mean, per seed
        'pydocs', 'standard', '2', '0.850 0.600 (0.725 +- 0.106)', '0.150 0.400 (0.275 +- 0.106)',
        '0.550 0.300 (0.425 +- 0.035)']}
    code, old, err = tabulate(capsys, runs / 'coupled-s1')
    assert code == 0 and 'Attention' not in old and '| pydocs | coupled | 1 |' in old


def test_the_report_draws_its_curves_where_plot_names(tmp_path, capsys):
    pytest.importorskip('matplotlib')
    fake_run(tmp_path / 'runs' / 'coupled-s1', CURVE, 8.0, attn='coupled')
    for plot in ('c.png', 'plots/c.png', 'R/curves'):  # in a folder not made yet; without an extension: a .png
        code, out, err = tabulate(capsys, tmp_path / 'runs', f'--plot={tmp_path / plot}')
        png = tmp_path / (plot if plot.endswith('.png') else plot + '.png')
        assert code == 0 and png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and '| coupled |' in out, err
    assert os.listdir(tmp_path / 'R') == ['curves.png'] and f"wrote {tmp_path / 'R' / 'curves.png'}" in err, err


def test_G4_plot_without_matplotlib_or_to_another_format_than_png_is_one_line(tmp_path, capsys, monkeypatch):
    fake_run(tmp_path / 'runs' / 'standard-s1', CURVE, 8.0)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, 'matplotlib', None)  # not installed
        code, out, err = tabulate(capsys, tmp_path / 'runs', f'--plot={tmp_path / "c.png"}')
    assert code == 1 and out == '' and err.strip() == (
        "error: --plot needs matplotlib (pip install matplotlib); without --plot, the tables need nothing")
    pytest.importorskip('matplotlib')
    code, out, err = tabulate(capsys, tmp_path / 'runs', f'--plot={tmp_path / "x.txt"}')
    assert code == 1 and out == '' and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --plot={tmp_path / 'x.txt'}: Format 'txt' is not supported") \
        and err.strip().endswith('; name a .png file'), err


def test_G3_a_row_compares_with_the_runs_that_trained_standard_whatever_their_folders_are_named(tmp_path, capsys):
    fake_run(tmp_path / 'standard', [(0, 5.0), (128, 3.0)], 9.0, attn='coupled')  # a coupled run, misnamed
    fake_run(tmp_path / 'baseline', [(0, 5.0), (128, 3.0)], 10.0)  # the real standard run
    code, out, err = tabulate(capsys, tmp_path)
    rows = table(out)
    assert code == 0 and rows['baseline'][4] == '+0.0%' and rows['standard'][4] == '-10.0%'
    assert list(rows).index('baseline') < list(rows).index('standard')  # standard attention's row first
    assert 'pydocs/standard: a folder named standard holds coupled runs' in err


def test_G4_a_report_of_no_runs_is_one_line(tmp_path, capsys):
    fake_run(tmp_path / 'runs' / 'standard-s1', CURVE, 8.0)
    fake_run(tmp_path / 'zero-s1', [(0, 5.0)], 150.0)  # --max_iters=0: no training, no run
    os.makedirs(tmp_path / 'empty')
    for folders, words in (([tmp_path / 'runs', tmp_path / 'no-such-runs'], "error: " + str(tmp_path / 'no-such-runs')
                            + " is not a folder; name run folders (the --out_dir of train.py), or folders above them"),
                           ([tmp_path / 'empty'], 'error: no finished train.py runs in'),
                           ([tmp_path / 'zero-s1'], 'error: no finished train.py runs in')):
        code, out, err = tabulate(capsys, *folders)
        assert code == 1 and out == '' and err.strip().splitlines()[-1].startswith(words), err


def test_the_sweep_tabulates_perplexity_failed_runs_and_spikes_against_a_setting(tmp_path, capsys):
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
    code, out, err = tabulate(capsys, runs, '--sweep=learning_rate')
    assert code == 0, err
    sweep = [line.split(' | ')[1:] for line in out.split('Sweep of learning_rate')[1].splitlines()
             if line.startswith('| pydocs')]
    assert sweep == [['coupled', '0.001', '2', '9.500 +- 0.707', '0', '0 (0) |'],
                     ['coupled', '0.004', '2', '8.000 +- 1.414', '0', '1 (1) |'],  # 2.3 > 1.1 * 2.0, after warmup
                     ['standard', '0.001', '2', '9.500 +- 0.707', '0', '0 (0) |'],
                     ['standard', '0.004', '2', '7.000', '1', '3 (2) |']]  # 2.3; 3.0 and 2.5 (> 2.2)
    assert table(out)['standard-4e-3'][3] == '7.000 (1 of 2 failed)'
    for key, words in (('learning_rat', 'no run logged it'), ('dataset', 'every run has dataset=pydocs')):
        code, out, err = tabulate(capsys, runs, f'--sweep={key}')  # a mistyped key, one no run varies: one line
        assert code == 1 and out == '' and err.strip() == (f"error: --sweep={key}: {words}; name a train.py setting "
                                                           "the runs vary, e.g. learning_rate")


def plotted(monkeypatch, capsys, *args):  # the sweep's picture: per panel, its x scale, label (then title) and lines
    pytest.importorskip('matplotlib')
    figures = []
    monkeypatch.setattr(report, 'save', lambda fig, path: figures.append(fig))
    code, out, err = tabulate(capsys, *args, '--plot=p.png')
    assert code == 0 and len(figures) == 1, err
    return out, [(ax.get_xscale(), f'{ax.get_xlabel()} | {ax.get_title()}',
                  [list(map(float, line.get_xdata())) for line in ax.lines])
                 for ax in figures[0].axes]


def test_a_sweep_of_any_key_plots_every_tabulated_value(tmp_path, capsys, monkeypatch):
    runs = tmp_path / 'runs'
    for i, (a, p) in enumerate((('standard', 0.0), ('standard', 0.1), ('standard', 0.2), ('coupled', 0.0))):
        fake_run(runs / f'{a}-{p}-s1', CURVE, 8.0 + i, attn=a, dropout=p)
    fake_run(runs / 'coupled-0.1-s1', CURVE, None, attn='coupled', dropout=0.1, diverged_at=2)
    fake_run(runs / 'standard-bias-s1', CURVE, 7.5, dropout=0.0, bias=True)  # set apart by more than the swept key
    out, [(scale, label, lines)] = plotted(monkeypatch, capsys, runs, '--sweep=dropout')
    assert scale == 'linear' and 'linear axis: a value is 0 or below' in label  # 0.0 on the axis
    assert sorted(lines) == [[], [], [0.0], [0.0], [0.0, 0.1, 0.2], [0.1]], lines  # coupled: 0.0, a cross at 0.1
    assert '| pydocs | standard [bias=False] | 0.2 |' in out and '| pydocs | standard [bias=True] | 0.0 |' in out
    assert 'x along the top, a failed run' in label  # (the title) coupled's seed at 0.1 diverged
    out, [(scale, label, lines)] = plotted(monkeypatch, capsys, runs, '--sweep=attn')  # categorical: a position each
    assert sorted(c[2] for c in table(out, 'Sweep of').values()) == ['coupled'] * 2 + ['standard'] * 4
    assert [0.0] in lines and lines.count([1.0]) == 4  # each standard row its own point: they differ in more


def test_variance_ratios_with_their_intervals(tmp_path, capsys, monkeypatch):
    runs = tmp_path / 'runs'
    for s in range(1, 6):  # 5 seeds: standard spread 2x coupled's (variance 4x); uncoupled: coupled's, shifted
        fake_run(runs / f'standard-s{s}', CURVE, 10.0 + 0.2 * s, seed=s)
        fake_run(runs / f'coupled-s{s}', CURVE, 10.0 + 0.1 * s, attn='coupled', seed=s)
        fake_run(runs / f'uncoupled-s{s}', CURVE, 9.0 + 0.1 * s, attn='uncoupled', seed=s)
    fake_run(runs / 'invertible-s1', CURVE, 9.0, attn='invertible')  # one seed: no variance
    code, out, err = tabulate(capsys, runs)
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
        code, out, err = tabulate(capsys, runs)
    assert code == 0 and '| coupled | 4.00 | - | - |' in out and 'need scipy (pip install scipy)' in err


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


def test_G4_a_section_script_takes_no_arguments_and_starts_no_run_when_given_some(tmp_path):
    for script, args, code, words in (('long.py', ['--help'], 0, 'Closer to convergence'),
                                      ('long.py', ['now'], 1, 'long.py takes no arguments'),
                                      ('sizes.py', ['-n'], 1, 'sizes.py takes no arguments'),
                                      ('laptop.py', ['--help'], 0, '99 runs')):  # before it prepares the corpora
        r = run(os.path.join(HERE, script), *args, cwd=tmp_path, timeout=120)
        assert r.returncode == code and words in r.stdout + r.stderr and 'training' not in r.stdout, r.stderr
        assert os.listdir(tmp_path) == []  # no runs/ made, here or anywhere


def test_the_runner_resumes_a_run_cut_short_and_keeps_its_output(tmp_path, monkeypatch):
    # results/runner.py with a stub train.py that prints its arguments: a folder with a checkpoint is resumed
    import runner
    (tmp_path / 'train.py').write_text("import sys\nprint(' '.join(sys.argv[1:]))\n")
    monkeypatch.setattr(runner, 'ROOT', str(tmp_path))
    out = tmp_path / 'runs' / 'coupled-s1'
    assert runner.train((str(out), '--attn=coupled')) == f"{out}: done"
    os.makedirs(out)
    (out / 'ckpt.pt').write_text('a checkpoint')  # the first attempt was cut short after a save
    runner.train((str(out), '--attn=coupled'))
    assert open(f"{out}.log").read().splitlines() == [f"--attn=coupled --out_dir={out}",
                                                      f"--attn=coupled --out_dir={out} --init_from=resume"]


def tables(text):  # the markdown tables in text: [[row, ...], ...]
    blocks = [b.splitlines() for b in ('\n'.join(line if line.startswith('|') else '' for line in text.splitlines())
                                       ).split('\n\n')]
    return [[row for row in b if row] for b in blocks if any(b)]


def test_a_clone_recomputes_sizes_md_from_its_kept_logs_with_no_corpus_and_no_training(tmp_path):
    """On a clone (its tracked files: runs' logs, no corpus, no checkpoint) results/sizes.py trains nothing and
    prints the tables results/sizes.md shows, to the digit."""
    root = os.path.dirname(HERE)
    kept = subprocess.run(['git', 'ls-files', 'runs', 'results/*.py', 'model.py'], cwd=root, capture_output=True,
                          text=True).stdout.split()
    if not any(f.startswith('runs/') for f in kept):
        pytest.skip('no kept runs here (not a git checkout, or none kept yet)')
    for f in kept:
        os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
        shutil.copy(os.path.join(root, f), tmp_path / f)
    r = run('results/sizes.py', cwd=tmp_path, env=dict(CORPORA_DIR=''), timeout=120)
    said = [line for line in r.stdout.splitlines() if 'runs finished already' in line or 'none trained' in line]
    assert said and all(line.endswith(('training 0, 2 at a time', 'none trained')) for line in said), r.stdout
    assert not os.path.exists(tmp_path / 'data') and 'stopped' not in r.stdout  # (a protocol under way: runs missing)
    page = tables(open(os.path.join(HERE, 'sizes.md')).read())
    assert tables(r.stdout) and all(t in page for t in tables(r.stdout)), r.stdout


def test_speed_keeps_bench_pys_records_and_prints_what_speed_md_quotes_beside_its_table(capsys):
    # results/speed.py's bench.py run, tiny (a timing is never asserted)
    import speed
    records = []
    flags = '--preset=tiny --vocab_size=64 --batch_size=2 --block_size=16 --new_tokens=4 --iters=1 --warmup=0'
    results = speed.bench_py(flags, records)
    out = capsys.readouterr().out
    assert 'KV cache generates 4 tokens' in out and 'FLOP model: vs standard, coupled +' in out, out[-1500:]
    assert len(records) == len(results) == 8 and all(r['flags'] == flags for r in records)
