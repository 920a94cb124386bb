/* reader._guarded_copy: memcpy out of a shard file's mapping that survives the file shrinking under it.
 *
 * A page of a shared file mapping that lies past the file's current end raises SIGBUS when touched:
 * a shard rewritten in place (`cp`, `rsync --inplace`) while a reader copies from its mapping would
 * kill the process. copy() runs its memcpy with a SIGBUS handler armed for exactly the source range,
 * on this thread: a fault there jumps back (siglongjmp) and copy() returns the bytes of the
 * destinations it had filled, which the caller reports as a changed file. Any other SIGBUS is handed to
 * the handler that was installed before (faulthandler, or the default: the process dies as before).
 * The handler is (re)installed by each copy() where someone replaced it since.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>

struct guard {
    sigjmp_buf jump;
    const char *start;
    const char *end;
};

/* initial-exec: the handler must not allocate this thread's TLS block (the copying thread has). */
static __thread struct guard *volatile armed __attribute__((tls_model("initial-exec")));
static struct sigaction previous;

static void on_sigbus(int signum, siginfo_t *info, void *context)
{
    struct guard *guard = armed;
    const char *address = info->si_addr;
    (void)context;
    if (guard != NULL && info->si_code > 0 && address >= guard->start && address < guard->end) {
        armed = NULL;
        siglongjmp(guard->jump, 1);
    }
    /* Not ours: restore the previous disposition; a fault then repeats under it, a sent signal is resent. */
    sigaction(SIGBUS, &previous, NULL);
    if (info->si_code <= 0) {
        raise(signum);
    }
}

static int install_handler(void)
{
    struct sigaction current, mine;
    if (sigaction(SIGBUS, NULL, &current) != 0) {
        return -1;
    }
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) {
        return 0;
    }
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigbus;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&mine.sa_mask);
    previous = current;
    return sigaction(SIGBUS, &mine, NULL);
}

PyDoc_STRVAR(copy_doc,
"copy(address, size, destinations) -> int\n\n"
"Copy consecutive bytes, from the ``size`` readable bytes at ``address`` (a mapping), into each\n"
"writable buffer of ``destinations`` in turn. Returns the bytes copied: the sum of the destinations'\n"
"lengths, or less when a page of the source raised SIGBUS (the file shrank): then only the\n"
"destinations filled before the fault count. ValueError when the destinations exceed ``size``.");

static PyObject *copy(PyObject *self, PyObject *args)
{
    unsigned long long address;
    Py_ssize_t size, count, k;
    PyObject *destinations, *sequence;
    Py_buffer *views;
    Py_ssize_t total = 0;
    volatile Py_ssize_t done = 0;
    struct guard guard;
    (void)self;

    if (!PyArg_ParseTuple(args, "KnO", &address, &size, &destinations)) {
        return NULL;
    }
    sequence = PySequence_Fast(destinations, "destinations must be a sequence of buffers");
    if (sequence == NULL) {
        return NULL;
    }
    count = PySequence_Fast_GET_SIZE(sequence);
    views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(sequence);
        return PyErr_NoMemory();
    }
    for (k = 0; k < count; k++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sequence, k), &views[k], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) {
            goto fail;
        }
        total += views[k].len;
    }
    if (total > size || size < 0) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes from a mapping of %zd", total, size);
        goto fail;
    }
    if (install_handler() != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    guard.start = (const char *)(uintptr_t)address;
    guard.end = guard.start + total;
    Py_BEGIN_ALLOW_THREADS
    if (sigsetjmp(guard.jump, 1) == 0) {
        armed = &guard;
        for (k = 0; k < count; k++) {
            memcpy(views[k].buf, guard.start + done, (size_t)views[k].len);
            done += views[k].len;
        }
        armed = NULL;
    }
    Py_END_ALLOW_THREADS
    for (k = 0; k < count; k++) {
        PyBuffer_Release(&views[k]);
    }
    PyMem_Free(views);
    Py_DECREF(sequence);
    return PyLong_FromSsize_t(done);

fail:
    for (k = 0; k < count; k++) {
        if (views[k].obj != NULL) {
            PyBuffer_Release(&views[k]);
        }
    }
    PyMem_Free(views);
    Py_DECREF(sequence);
    return NULL;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_guarded_copy",
    "memcpy out of a file mapping that returns short instead of dying when the file shrinks (SIGBUS).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__guarded_copy(void)
{
    return PyModule_Create(&module);
}
