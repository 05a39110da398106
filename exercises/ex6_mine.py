# Exercise 6: your own integrator. A copy of leapfrog, registered under the new name 'mine', to change into a step the
# table lacks (drift-kick-drift, Yoshida's fourth order, a Runge-Kutta step). A template, not a script: append it to
# the end of model.py, once:
#     cat exercises/ex6_mine.py >> model.py          (undo: git checkout model.py)
# then claim its promises in the Integrator line and check them:
#     python -m pytest -q test_model.py exercises/test_lab.py -k mine
if 'INTEGRATORS' not in globals():  # run by itself
    raise SystemExit("error: exercises/ex6_mine.py is a template, not a script: append it to model.py with "
                     "`cat exercises/ex6_mine.py >> model.py`, then edit it there")
if 'mine' in INTEGRATORS:  # appended a second time
    raise SystemExit("error: model.py holds exercises/ex6_mine.py twice; delete the second copy from the end of "
                     "model.py, or start again with `git checkout model.py`")


def mine(h, q, k, dt):  # one step of size dt, (q, k) -> (q, k); h.force(q, c) is c F(q)
    # write q = q + ..., not q += ...: an update in place breaks autograd
    k = k + h.force(q, dt / 2)  # kick:  k += dt/2 F(q)
    q = q + dt * k              # drift: q += dt k
    k = k + h.force(q, dt / 2)  # kick:  k += dt/2 F(q)
    return q, k


INTEGRATORS['mine'] = Integrator(mine, symplectic=True, volume_preserving=True, symmetric=True, order=2,  # your claims
                                 forces=2, vector_ops=4)  # leapfrog's cost a step: 2 forces, 4 vector ops; set yours
QK_TRANSFORMS['mine'] = dynamics('mine')  # mine with the potential's force; dynamics('mine', 'mlp'): the free force
