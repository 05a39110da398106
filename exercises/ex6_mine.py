# Exercise 6: your own integrator. A copy of leapfrog, registered under the new name 'mine', to change into a step the
# table lacks (drift-kick-drift, Yoshida's fourth order, a Runge-Kutta step). Add it to the end of model.py:
#     cat exercises/ex6_mine.py >> model.py          (undo: git checkout model.py)
# then claim its promises in the Integrator line and check them: python -m pytest -q test_model.py -k mine
# (a name already in the tables is refused: keep 'mine', or pick another new one)


def mine(h, q, k, dt, kick):  # one step of size dt; h.force(q, c) is c F(q); kick: unused here
    k = k + h.force(q, dt / 2)  # kick:  k += dt/2 F(q)
    q = q + dt * k              # drift: q += dt k
    return q, k + h.force(q, dt / 2), None  # kick again; None: no force for the next step to reuse


INTEGRATORS['mine'] = Integrator(mine, symplectic=True, symmetric=True, order=2)  # your claims
QK_TRANSFORMS['mine'] = QKTransform(Hamiltonian, lambda c: dict(integrator='mine', dt=c.qk_dt), lambda m: m,
                                    lambda hs, m, n: (2 * n * 4 * m * hs, n * (20 * m + 6 * hs)))  # 2 forces a step
