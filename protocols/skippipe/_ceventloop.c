/* The simulator's event loop in C: `_eventloop.py` line for line, about ten times faster.
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
#include <string.h>

typedef struct {
    double t;
    long long seq;
    int node, i, step; /* step >= 0: arrives; -1 - step: finishes */
} Event;

typedef struct {
    double t;
    int i, step;
} Wait;

typedef struct {
    Event *a;
    Py_ssize_t n, cap;
} EventHeap;

typedef struct {
    Wait *a;
    Py_ssize_t n, cap;
} WaitHeap;

typedef struct {
    PyObject_HEAD
    int n_nodes, n_chains, fifo;
    char *busy;
    double *until;
    long long *held;
    WaitHeap *back, *fwd; /* fwd == back when fifo */
    EventHeap events;
    long long seq, collisions;
    double queueing, now;
    Py_ssize_t *offsets; /* chain i's ends are ends[offsets[i] .. offsets[i + 1]) */
    double *ends;
} State;

static PyTypeObject StateType;

/* ---- heaps ---------------------------------------------------------------------------------------- */

static int event_less(const Event *x, const Event *y) {
    return x->t < y->t || (x->t == y->t && x->seq < y->seq);
}

static int wait_less(const Wait *x, const Wait *y) {
    if (x->t != y->t) return x->t < y->t;
    if (x->i != y->i) return x->i < y->i;
    return x->step < y->step;
}

static int grow(void **a, Py_ssize_t *cap, size_t size) {
    Py_ssize_t cap2 = *cap ? *cap * 2 : 8;
    void *b = PyMem_Realloc(*a, (size_t)cap2 * size);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *a = b;
    *cap = cap2;
    return 0;
}

static int event_push(EventHeap *h, Event e) {
    if (h->n == h->cap && grow((void **)&h->a, &h->cap, sizeof(Event)) < 0) return -1;
    Py_ssize_t k = h->n++;
    while (k > 0) {
        Py_ssize_t parent = (k - 1) / 2;
        if (!event_less(&e, &h->a[parent])) break;
        h->a[k] = h->a[parent];
        k = parent;
    }
    h->a[k] = e;
    return 0;
}

static Event event_pop(EventHeap *h) {
    Event top = h->a[0], last = h->a[--h->n];
    Py_ssize_t k = 0, n = h->n;
    for (;;) {
        Py_ssize_t child = 2 * k + 1;
        if (child >= n) break;
        if (child + 1 < n && event_less(&h->a[child + 1], &h->a[child])) child++;
        if (!event_less(&h->a[child], &last)) break;
        h->a[k] = h->a[child];
        k = child;
    }
    if (n > 0) h->a[k] = last;
    return top;
}

static int wait_push(WaitHeap *h, double t, int i, int step) {
    Wait w = {t, i, step};
    if (h->n == h->cap && grow((void **)&h->a, &h->cap, sizeof(Wait)) < 0) return -1;
    Py_ssize_t k = h->n++;
    while (k > 0) {
        Py_ssize_t parent = (k - 1) / 2;
        if (!wait_less(&w, &h->a[parent])) break;
        h->a[k] = h->a[parent];
        k = parent;
    }
    h->a[k] = w;
    return 0;
}

static Wait wait_pop(WaitHeap *h) {
    Wait top = h->a[0], last = h->a[--h->n];
    Py_ssize_t k = 0, n = h->n;
    for (;;) {
        Py_ssize_t child = 2 * k + 1;
        if (child >= n) break;
        if (child + 1 < n && wait_less(&h->a[child + 1], &h->a[child])) child++;
        if (!wait_less(&h->a[child], &last)) break;
        h->a[k] = h->a[child];
        k = child;
    }
    if (n > 0) h->a[k] = last;
    return top;
}

/* ---- the state ------------------------------------------------------------------------------------ */

static State *state_alloc(int n_nodes, int n_chains, int fifo, Py_ssize_t n_ends) {
    State *s = PyObject_New(State, &StateType);
    if (s == NULL) return NULL;
    s->n_nodes = n_nodes;
    s->n_chains = n_chains;
    s->fifo = fifo;
    s->busy = PyMem_Calloc((size_t)n_nodes + 1, 1);
    s->until = PyMem_Calloc((size_t)n_nodes + 1, sizeof(double));
    s->held = PyMem_Calloc((size_t)n_nodes + 1, sizeof(long long));
    s->back = PyMem_Calloc((size_t)n_nodes + 1, sizeof(WaitHeap));
    s->fwd = fifo ? s->back : PyMem_Calloc((size_t)n_nodes + 1, sizeof(WaitHeap));
    s->events.a = NULL;
    s->events.n = s->events.cap = 0;
    s->offsets = PyMem_Calloc((size_t)n_chains + 1, sizeof(Py_ssize_t));
    s->ends = PyMem_Calloc((size_t)n_ends + 1, sizeof(double));
    s->seq = s->collisions = 0;
    s->queueing = s->now = 0.0;
    if (!s->busy || !s->until || !s->held || !s->back || !s->fwd || !s->offsets || !s->ends) {
        Py_DECREF(s);
        PyErr_NoMemory();
        return NULL;
    }
    return s;
}

static void free_heaps(WaitHeap *heaps, int n) {
    if (heaps == NULL) return;
    for (int k = 0; k < n; k++) PyMem_Free(heaps[k].a);
    PyMem_Free(heaps);
}

static void State_dealloc(State *s) {
    if (s->fwd != s->back) free_heaps(s->fwd, s->n_nodes);
    free_heaps(s->back, s->n_nodes);
    PyMem_Free(s->busy);
    PyMem_Free(s->until);
    PyMem_Free(s->held);
    PyMem_Free(s->events.a);
    PyMem_Free(s->offsets);
    PyMem_Free(s->ends);
    PyObject_Free(s);
}

static int copy_heaps(WaitHeap *to, const WaitHeap *from, int n) {
    for (int k = 0; k < n; k++) {
        to[k].n = to[k].cap = from[k].n;
        to[k].a = NULL;
        if (from[k].n) {
            to[k].a = PyMem_Malloc((size_t)from[k].n * sizeof(Wait));
            if (to[k].a == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memcpy(to[k].a, from[k].a, (size_t)from[k].n * sizeof(Wait));
        }
    }
    return 0;
}

static State *state_copy(const State *s) {
    Py_ssize_t n_ends = s->offsets[s->n_chains];
    State *c = state_alloc(s->n_nodes, s->n_chains, s->fifo, n_ends);
    if (c == NULL) return NULL;
    memcpy(c->busy, s->busy, (size_t)s->n_nodes);
    memcpy(c->until, s->until, (size_t)s->n_nodes * sizeof(double));
    memcpy(c->held, s->held, (size_t)s->n_nodes * sizeof(long long));
    memcpy(c->offsets, s->offsets, ((size_t)s->n_chains + 1) * sizeof(Py_ssize_t));
    memcpy(c->ends, s->ends, (size_t)n_ends * sizeof(double));
    if (copy_heaps(c->back, s->back, s->n_nodes) < 0 ||
        (!s->fifo && copy_heaps(c->fwd, s->fwd, s->n_nodes) < 0)) {
        Py_DECREF(c);
        return NULL;
    }
    if (s->events.n) {
        c->events.a = PyMem_Malloc((size_t)s->events.n * sizeof(Event));
        if (c->events.a == NULL) {
            Py_DECREF(c);
            PyErr_NoMemory();
            return NULL;
        }
        memcpy(c->events.a, s->events.a, (size_t)s->events.n * sizeof(Event));
    }
    c->events.n = c->events.cap = s->events.n;
    c->seq = s->seq;
    c->collisions = s->collisions;
    c->queueing = s->queueing;
    c->now = s->now;
    return c;
}

/* A task of a chain: (node, is_forward, seconds, releases_memory), read in place. */
typedef struct {
    int node, forward, releases;
    double seconds;
} Task;

/* A float or an int as Python adds it to a float; anything else is refused (no Python code runs here). */
static int number(PyObject *x, double *out) {
    if (PyFloat_Check(x)) {
        *out = PyFloat_AS_DOUBLE(x);
        return 0;
    }
    if (PyLong_Check(x)) {
        *out = PyLong_AsDouble(x);
        return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
    }
    PyErr_SetString(PyExc_TypeError, "times must be floats or ints");
    return -1;
}

static int read_task(PyObject *chains, int i, int step, Task *t) {
    PyObject *chain = PyList_GET_ITEM(chains, i);
    if (step >= PyList_GET_SIZE(chain)) {
        PyErr_SetString(PyExc_ValueError, "a chain is shorter than its state's");
        return -1;
    }
    PyObject *task = PyList_GET_ITEM(chain, step);
    if (!PyTuple_Check(task) || PyTuple_GET_SIZE(task) != 4 || !PyLong_Check(PyTuple_GET_ITEM(task, 0)) ||
        !PyBool_Check(PyTuple_GET_ITEM(task, 1)) || !PyBool_Check(PyTuple_GET_ITEM(task, 3))) {
        PyErr_SetString(PyExc_TypeError, "a task must be a (node, is_forward, seconds, releases) tuple");
        return -1;
    }
    long node = PyLong_AsLong(PyTuple_GET_ITEM(task, 0));
    if (node == -1 && PyErr_Occurred()) return -1;
    t->node = node < 0 || node > INT_MAX ? -1 : (int)node;
    t->forward = PyTuple_GET_ITEM(task, 1) == Py_True;
    t->releases = PyTuple_GET_ITEM(task, 3) == Py_True;
    return number(PyTuple_GET_ITEM(task, 2), &t->seconds);
}

static int check_chains(PyObject *chains, int n_chains, int n_nodes) {
    if (!PyList_Check(chains) || PyList_GET_SIZE(chains) != n_chains) {
        PyErr_SetString(PyExc_TypeError, "chains must be a list with one chain per microbatch of the state");
        return -1;
    }
    for (int i = 0; i < n_chains; i++) {
        PyObject *chain = PyList_GET_ITEM(chains, i);
        if (!PyList_Check(chain) || PyList_GET_SIZE(chain) == 0) {
            PyErr_SetString(PyExc_TypeError, "a chain must be a non-empty list of tasks");
            return -1;
        }
        for (Py_ssize_t step = 0; step < PyList_GET_SIZE(chain); step++) {
            Task t;
            if (read_task(chains, i, (int)step, &t) < 0) return -1;
            if (t.node < 0 || t.node >= n_nodes) {
                PyErr_SetString(PyExc_ValueError, "a task names a node outside the state");
                return -1;
            }
        }
    }
    return 0;
}

static PyObject *State_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"chains", "n_nodes", "fifo", NULL};
    PyObject *chains;
    int n_nodes, fifo;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!ip", names, &PyList_Type, &chains, &n_nodes, &fifo))
        return NULL;
    if (n_nodes < 0) {
        PyErr_SetString(PyExc_ValueError, "n_nodes must not be negative");
        return NULL;
    }
    Py_ssize_t n_chains = PyList_GET_SIZE(chains);
    if (n_chains > INT_MAX / 2 || check_chains(chains, (int)n_chains, n_nodes) < 0) return NULL;
    Py_ssize_t n_ends = 0;
    for (Py_ssize_t i = 0; i < n_chains; i++) n_ends += PyList_GET_SIZE(PyList_GET_ITEM(chains, i));
    State *s = state_alloc(n_nodes, (int)n_chains, fifo, n_ends);
    if (s == NULL) return NULL;
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n_chains; i++) {
        s->offsets[i] = at;
        Py_ssize_t length = PyList_GET_SIZE(PyList_GET_ITEM(chains, i));
        for (Py_ssize_t k = 0; k < length; k++) s->ends[at + k] = Py_HUGE_VAL;
        at += length;
        Task first;
        if (read_task(chains, (int)i, 0, &first) < 0) {
            Py_DECREF(s);
            return NULL;
        }
        Event e = {0.0, (long long)i, first.node, (int)i, 0};
        if (event_push(&s->events, e) < 0) {
            Py_DECREF(s);
            return NULL;
        }
    }
    s->offsets[n_chains] = at;
    s->seq = n_chains;
    return (PyObject *)s;
}

static PyObject *State_copy(State *s, PyObject *unused) {
    return (PyObject *)state_copy(s);
}

static PyObject *State_ends(State *s, void *unused) {
    PyObject *out = PyList_New(s->n_chains);
    if (out == NULL) return NULL;
    for (int i = 0; i < s->n_chains; i++) {
        Py_ssize_t start = s->offsets[i], length = s->offsets[i + 1] - start;
        PyObject *row = PyList_New(length);
        if (row == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        for (Py_ssize_t k = 0; k < length; k++) {
            PyObject *x = PyFloat_FromDouble(s->ends[start + k]);
            if (x == NULL) {
                Py_DECREF(row);
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(row, k, x);
        }
        PyList_SET_ITEM(out, i, row);
    }
    return out;
}

static PyObject *State_now(State *s, void *unused) { return PyFloat_FromDouble(s->now); }
static PyObject *State_collisions(State *s, void *unused) { return PyLong_FromLongLong(s->collisions); }
static PyObject *State_queueing(State *s, void *unused) { return PyFloat_FromDouble(s->queueing); }

static PyMethodDef State_methods[] = {
    {"copy", (PyCFunction)State_copy, METH_NOARGS, "An independent copy of the state."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef State_getset[] = {
    {"now", (getter)State_now, NULL, "The instant the state is at.", NULL},
    {"collisions", (getter)State_collisions, NULL, "Tasks that found their node busy or queued.", NULL},
    {"queueing", (getter)State_queueing, NULL, "Seconds tasks waited at their nodes, in sum.", NULL},
    {"ends", (getter)State_ends, NULL, "Per chain, when each task ended (inf: not yet).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "protocols.skippipe._ceventloop.State",
    .tp_doc = "What the event loop carries from one instant to the next.",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = State_new,
    .tp_dealloc = (destructor)State_dealloc,
    .tp_methods = State_methods,
    .tp_getset = State_getset,
};

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
