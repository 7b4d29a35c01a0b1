/* The simulator's event loop in C: `_eventloop.py` line for line, 7x faster (a whole `Simulator.run` of the
 * reference plan, its Python around the loop included: 68 against 500 us).
 *
 * Same API: State(chains, n_nodes, fifo), state.copy(), state.now / .collisions / .queueing / .ends, and
 * play(state, chains, links, memory, bound, snapshots, stride, rests). Same results to the last bit: every
 * time is a sum of two doubles taken in the order Python takes it (built with -ffp-contract=off), and every
 * heap orders unique keys, so any heap pops what heapq pops. Events are (time, seq), waiting tasks (time,
 * microbatch, step), as in the Python loop. `chains`, `links` and `rests` are read in place, not copied.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "_ceventloop_heaps.h"
#include "_ceventloop_state.h"

/* ---- the loop ------------------------------------------------------------------------------------- */

static int read_link(PyObject *links, int a, int b, double *out) {
    PyObject *row = PySequence_Fast_GET_ITEM(links, a);
    if (!PyTuple_Check(row) && !PyList_Check(row)) {
        PyErr_SetString(PyExc_TypeError, "links must be rows of numbers");
        return -1;
    }
    if (b >= PySequence_Fast_GET_SIZE(row)) {
        PyErr_SetString(PyExc_ValueError, "a row of links is too short");
        return -1;
    }
    return number(PySequence_Fast_GET_ITEM(row, b), out);
}

static int read_rest(PyObject *rests, int i, int step, double *out) {
    PyObject *row = PyList_GET_ITEM(rests, i);
    if (!PyList_Check(row) || step >= PyList_GET_SIZE(row)) {
        PyErr_SetString(PyExc_ValueError, "rests must be a list of floats per task of each chain");
        return -1;
    }
    return number(PyList_GET_ITEM(row, step), out);
}

#define TRY(x)                   \
    do {                         \
        if ((x) < 0) goto error; \
    } while (0)

/* 1: played to the end; 0: sure to end after `bound`; -1: an error is set. */
static int play_loop(State *s, PyObject *chains, PyObject *links, long long memory, double bound,
                     PyObject *snapshots, Py_ssize_t stride, PyObject *rests) {
    double limit = bound + 1e-9 * (fabs(bound) > 1.0 ? fabs(bound) : 1.0);
    int n = s->n_nodes, fifo = s->fifo, result = 1;
    char *busy = s->busy;
    double *until = s->until;
    long long *held = s->held;
    WaitHeap *waiting_back = s->back, *waiting_fwd = s->fwd;
    EventHeap *events = &s->events;
    double now = s->now, rest, link;
    char *pending = PyMem_Calloc((size_t)n + 1, 1);
    int *dispatch = PyMem_Malloc(((size_t)n + 1) * sizeof(int)); /* a ring: a node is in it at most once */
    Py_ssize_t head = 0, queued = 0, since = 0;
    Task task;
    if (pending == NULL || dispatch == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    if (events->n && events->a[0].t > bound) goto late;
    for (;;) {
        int node, i, step;
        int dispatching = queued > 0;
        if (events->n && (!dispatching || events->a[0].t == now)) {
            if (events->a[0].t != now) { /* a new instant */
                if (events->a[0].t > bound) goto late;
                if (snapshots != NULL && since >= stride) {
                    s->now = events->a[0].t;
                    State *copy = state_copy(s);
                    if (copy == NULL) goto error;
                    int appended = PyList_Append(snapshots, (PyObject *)copy);
                    Py_DECREF(copy);
                    TRY(appended);
                    since = 0;
                }
            }
            Event e = event_pop(events);
            now = e.t;
            node = e.node;
            i = e.i;
            step = e.step;
            since++;
            if (step >= 0) { /* a task arrives; it starts no sooner than its node is free */
                if (rests != NULL) {
                    TRY(read_rest(rests, i, step, &rest));
                    if ((busy[node] ? until[node] : now) + rest > limit) goto late;
                }
                TRY(read_task(chains, i, step, &task));
                if (busy[node]) {
                    s->collisions++;
                    TRY(wait_push(task.forward ? &waiting_fwd[node] : &waiting_back[node], now, i, step));
                    continue;
                }
                if (waiting_back[node].n || waiting_fwd[node].n) {
                    s->collisions++;
                } else if (!dispatching && (!events->n || events->a[0].t != now) &&
                           (!task.forward || held[node] < memory)) {
                    /* alone at an idle node, nothing else due at this instant: it starts at once */
                    held[node] += task.forward;
                    busy[node] = 1;
                    until[node] = now + task.seconds;
                    Event done = {until[node], s->seq++, node, i, -1 - step};
                    TRY(event_push(events, done));
                    continue;
                }
                TRY(wait_push(task.forward ? &waiting_fwd[node] : &waiting_back[node], now, i, step));
            } else { /* a task finishes */
                step = -1 - step;
                busy[node] = 0;
                Py_ssize_t length = s->offsets[i + 1] - s->offsets[i];
                if (step >= length) {
                    PyErr_SetString(PyExc_ValueError, "a chain is longer than its state's");
                    goto error;
                }
                s->ends[s->offsets[i] + step] = now;
                TRY(read_task(chains, i, step, &task));
                if (task.releases) held[node] -= 1; /* a backward pass frees its memory slot */
                if (step + 1 < PyList_GET_SIZE(PyList_GET_ITEM(chains, i))) {
                    TRY(read_task(chains, i, step + 1, &task));
                    int next = task.node;
                    TRY(read_link(links, node, next, &link));
                    double arrive = now + link;
                    if (busy[next] && until[next] > arrive) {
                        /* it will find next busy, and nothing is served there before then: queue it now */
                        if (rests != NULL) {
                            TRY(read_rest(rests, i, step + 1, &rest));
                            if (until[next] + rest > limit) goto late;
                        }
                        s->collisions++;
                        TRY(wait_push(task.forward ? &waiting_fwd[next] : &waiting_back[next], arrive, i,
                                      step + 1));
                    } else {
                        Event e2 = {arrive, s->seq++, next, i, step + 1};
                        TRY(event_push(events, e2));
                    }
                }
                if (!waiting_back[node].n && !waiting_fwd[node].n) continue; /* nothing to serve */
            }
            if (queued || (events->n && events->a[0].t == now)) {
                if (!pending[node]) {
                    pending[node] = 1;
                    dispatch[(head + queued++) % (n + 1)] = node;
                }
                continue;
            }
            /* nothing else is due at this instant: serve `node` now */
        } else if (dispatching) {
            node = dispatch[head];
            head = (head + 1) % (n + 1);
            queued--;
            pending[node] = 0;
            if (busy[node]) continue;
        } else {
            break;
        }
        Wait ready;
        if (waiting_back[node].n && !fifo) {
            ready = wait_pop(&waiting_back[node]);
        } else if (waiting_fwd[node].n && held[node] < memory) {
            ready = wait_pop(&waiting_fwd[node]);
            TRY(read_task(chains, ready.i, ready.step, &task));
            if (task.forward) held[node] += 1;
        } else {
            continue;
        }
        if (rests != NULL) {
            TRY(read_rest(rests, ready.i, ready.step, &rest));
            if (now + rest > limit) goto late;
        }
        TRY(read_task(chains, ready.i, ready.step, &task));
        s->queueing += now - ready.t;
        busy[node] = 1;
        until[node] = now + task.seconds;
        Event done = {until[node], s->seq++, node, ready.i, -1 - ready.step};
        TRY(event_push(events, done));
    }
    s->now = now;
    goto out;
late:
    result = 0;
    goto out;
error:
    result = -1;
out:
    PyMem_Free(pending);
    PyMem_Free(dispatch);
    return result;
}

static PyObject *play(PyObject *module, PyObject *args) {
    State *s;
    PyObject *chains, *links, *snapshots, *rests;
    long long memory;
    double bound;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "O!OOLdOnO", &StateType, &s, &chains, &links, &memory, &bound, &snapshots,
                          &stride, &rests))
        return NULL;
    if (check_chains(chains, s->n_chains, s->n_nodes) < 0) return NULL;
    PyObject *rows = PySequence_Fast(links, "links must be a sequence of rows");
    if (rows == NULL) return NULL;
    int ok = PySequence_Fast_GET_SIZE(rows) >= s->n_nodes;
    if (ok && rests != Py_None) ok = PyList_Check(rests) && PyList_GET_SIZE(rests) == s->n_chains;
    if (ok && snapshots != Py_None) ok = PyList_Check(snapshots);
    if (!ok) {
        Py_DECREF(rows);
        PyErr_SetString(PyExc_TypeError, "links need a row per node, rests and snapshots must be lists");
        return NULL;
    }
    int done = play_loop(s, chains, rows, memory, bound, snapshots == Py_None ? NULL : snapshots, stride,
                         rests == Py_None ? NULL : rests);
    Py_DECREF(rows);
    if (done < 0) return NULL;
    return PyBool_FromLong(done);
}

static PyMethodDef module_methods[] = {
    {"play", play, METH_VARARGS,
     "play(state, chains, links, memory, bound, snapshots, stride, rests): _eventloop.play in C."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ceventloop", "The simulator's event loop in C (see _eventloop.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__ceventloop(void) {
    if (PyType_Ready(&StateType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&StateType);
    if (PyModule_AddObject(m, "State", (PyObject *)&StateType) < 0) {
        Py_DECREF(&StateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
