/* The event loop's two heaps: events by (time, sequence) and tasks waiting at a node by (time, microbatch,
 * step). Keys are unique, so a pop returns what Python's heapq pops from the same pushes. */
#ifndef SWARMNODE_CEVENTLOOP_HEAPS_H
#define SWARMNODE_CEVENTLOOP_HEAPS_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

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

#endif
