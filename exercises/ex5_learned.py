"""Exercise 5. What did the quick start's model learn? Per layer its nonlinearity and dt; a line of text through
layer 1, attention with the learned dt and with dt = 0 (one run: the quick start's, in out/).
Run from the repository root: python exercises/ex5_learned.py [run folder] (default: out; the lab's own copy of a
quick-start run: exercises/quickstart)"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model.py, from any folder
from model import GPT, GPTConfig, qk_diagnostics  # noqa: E402

run = sys.argv[1] if len(sys.argv) > 1 else 'out'
QUICK = "python exercises/ex5_learned.py exercises/quickstart"  # the lab's own copy of a quick-start run
if run in ('-h', '--help'):
    sys.exit(print(__doc__))
if os.path.basename(run) == 'ckpt.pt' and os.path.isfile(run):  # the checkpoint named: its run folder
    run = os.path.dirname(run) or '.'
if not run.strip():
    sys.exit(f"error: the run folder is empty; name one (train.py's --out_dir), e.g. {QUICK}")
lab_copy = os.path.realpath(run) == os.path.join(os.path.dirname(os.path.realpath(__file__)), 'quickstart')
copy = "restore the lab's copy: git checkout exercises/quickstart" if lab_copy else f"use the lab's copy: {QUICK}"
if not os.path.exists(os.path.join(run, 'ckpt.pt')):
    sys.exit(f"error: no {run}/ckpt.pt; wait for the quick start to finish, or {copy}")
try:
    ckpt = torch.load(os.path.join(run, 'ckpt.pt'), weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']), verbose=False).eval()
    model.load_state_dict(ckpt['model'])
except Exception as e:  # a partial copy, a checkpoint still being written, another program's file
    # (train.py refuses a folder that holds a run, even a broken one)
    again = '' if lab_copy else "train another into a new folder (`python train.py " \
        "--attn=coupled --out_dir=<new folder>`), or "
    sys.exit(f"error: {run}/ckpt.pt cannot be read ({type(e).__name__}); {again}{copy}")
qk = model.transformer.h[1].attn.qk if model.config.n_layer > 1 else None
if not (hasattr(qk, 'force') and hasattr(qk, 'dt')):  # standard attention has no q/k map; uncoupled no force
    layers = f"{model.config.n_layer} layer{'s' * (model.config.n_layer != 1)}"
    sys.exit(f"error: {run} is an --attn={model.config.attn} run with {layers}; exercise 5 reads "
             f"layer 1's Hamiltonian step: train one with `python train.py --attn=coupled`, or use {QUICK}")
if model.config.block_size < 48:  # the printed line is 48 positions
    sys.exit(f"error: {run} has block_size {model.config.block_size}, exercise 5 reads a line of 48 positions: "
             f"train with `python train.py --attn=coupled` (block_size 128), or use {QUICK}")
config = ckpt.get('config', {})  # the run's corpus: its val split (the lab's copy keeps the part read here)
path = os.path.join(run, 'val.bin')
if not os.path.exists(path):
    path = os.path.join(config.get('data_dir', 'data'), config.get('dataset', 'pydocs'), 'val.bin')
if not os.path.exists(path):
    prepare = 'python prepare_data.py' + ('' if config.get('dataset', 'pydocs') == 'pydocs' else f" {config['dataset']}")
    sys.exit(f"error: no {run}/val.bin and no {path}; run `{prepare}` in the repository root first")
val, T = np.fromfile(path, dtype=np.uint16).astype(np.int64), model.config.block_size
if len(val) < max(16 * T, 2048):
    sys.exit(f"error: {path} holds {len(val)} tokens, exercise 5 reads {max(16 * T, 2048)}; run "
             "`python prepare_data.py --force` in the repository root")
for i, s in enumerate(qk_diagnostics(model, torch.from_numpy(val[:16 * T]).view(16, T))):
    print(f"layer {i}: nonlinear {s['nonlinear']:.2%}, dt {np.round(model.transformer.h[i].attn.qk.dt.tolist(), 3)}")
start = 1000 + bytes(val[1000:2000].astype(np.uint8)).index(b'\n') + 1  # a line of val text
print('on:', bytes(val[start:start + 48].astype(np.uint8)).decode(errors='replace'))
seen = []  # layer 1's q/k map: its input (dt = 0), output (learned dt), (1, n_head, 48, head_size)
hook = qk.register_forward_hook(lambda m, inp, out: seen.append((*inp, *out)))
with torch.no_grad():
    model(torch.from_numpy(val[start:start + 48])[None])
    hook.remove()
    q, k, q1, k1 = (t[0] for t in seen[0])  # (n_head, 48, hs)
    dt = qk.dt.view(-1, 1)  # (n_head, 1): each head's learned step
    mask, S = torch.ones(48, 48, dtype=torch.bool).tril(), lambda a, b: a @ b.transpose(-1, -2)  # S: a_i . b_j
    attend = lambda q, k: (S(q, k) / q.size(-1) ** 0.5).masked_fill(~mask, float('-inf')).softmax(-1)  # noqa: E731
    p0, p1 = attend(q, k), attend(q1, k1)  # (n_head, 48, 48): row i is where token i looks
    change = S(q1, k1) - S(q, k)  # (n_head, 48, 48): how each score moved
    kk, first = dt * S(k, k)[:, mask], dt * (S(k, k) + S(q, qk.force(q)))[:, mask]  # dt k_i.k_j; + dt q_i.F(q_j)
    gain = change.masked_fill(~mask, float('-inf'))  # the score gains, (n_head, 48, 48); -inf: not attended
    pgain = (p1 - p0).masked_fill(~mask, float('-inf'))  # the attention gains: what the softmax makes of them
    r2 = lambda pred: 1 - (gain_ - pred).pow(2).sum(-1) / (gain_ - gain_.mean(-1, keepdim=True)).pow(2).sum(-1)  # noqa
    gain_ = change[:, mask]  # the causal pairs' score changes, (n_head, pairs)
    diagonal, rows = torch.arange(48), lambda x: f"{x.sum()}/48"  # noqa: E731  how many rows of 48
    for h in range(len(p0)):
        print(f"head {h}: total variation {0.5 * (p1[h] - p0[h]).abs().sum(-1).mean():.3f}, argmax flips "
              f"{rows(p1[h].argmax(-1) != p0[h].argmax(-1))}, corr(change, k_i.k_j) "
              f"{torch.corrcoef(torch.stack((gain_[h], kk[h])))[0, 1]:+.2f}, R^2 {r2(kk)[h]:.2f} (dt k_i.k_j alone), "
              f"{r2(first)[h]:.2f} (first order)")
        print(f"head {h}: the diagonal's score rises in {rows(gain[h].diagonal() > 0)} rows, its attention falls in "
              f"{rows(pgain[h].diagonal() < 0)}; the largest gain is the diagonal's in "
              f"{rows(gain[h].argmax(-1) == diagonal)} rows by score, {rows(pgain[h].argmax(-1) == diagonal)} by attention")
try:
    import matplotlib.pyplot as plt
    d, (fig, ax) = (p1 - p0).abs().max().item(), plt.subplots(3, len(p0), figsize=(10.4, 7.5))
    for h, row in ((h, row) for h in range(len(p0)) for row in range(3)):  # the change: red gains, blue loses
        ax[row, h].imshow((p0, p1, p1 - p0)[row][h], **(dict(cmap='RdBu_r', vmin=-d, vmax=d) if row == 2 else {}))
        ax[row, h].set(title=f"head {h}: " + ('dt = 0', 'learned dt', f'change, +-{d:.2f}')[row], xticks=[], yticks=[])
    fig.tight_layout(), fig.savefig('ex5_attention.png', dpi=80)
    print("drew ex5_attention.png")
except ImportError:
    print("for the picture: pip install matplotlib")
