/* The loop's state as a Python object (`_eventloop.State`'s twin), and how a chain's task is read. */
#ifndef SWARMNODE_CEVENTLOOP_STATE_H
#define SWARMNODE_CEVENTLOOP_STATE_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <string.h>

#include "_ceventloop_heaps.h"

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

#endif
