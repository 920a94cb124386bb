/* reader._fork_guard: CPython's fix for python/cpython#112275, for the releases without it.
 *
 * In the child of os.fork(), CPython before 3.10.15 and 3.11.10 takes the interpreter-list lock
 * (HEAD_LOCK, _PyRuntime.interpreters.mutex) to delete the other threads' states before it
 * re-initialises that lock. A thread of the parent that held it at the fork, as a C++ thread does
 * when it enters the interpreter (PyGILState_Ensure creates its thread state under that lock, without
 * the GIL), leaves it locked in the child, which then waits forever. install() registers a
 * pthread_atfork child handler that gives the child a new, unlocked lock first, as the fixed releases
 * do; glibc runs it inside fork(), before os.fork() calls PyOS_AfterFork_Child. As there, the old
 * lock is leaked, not freed: it may be in any state. The handler is built for 3.10 and 3.11 only
 * (3.12 has the fix; there install() returns False); reader/fork_guard.py decides where to install it.
 */
#define PY_SSIZE_T_CLEAN
#define Py_BUILD_CORE_MODULE
#include <Python.h>
#include <pthread.h>

#if PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030C0000
#include "internal/pycore_pymem.h"
#include "internal/pycore_runtime.h"
#define FORK_GUARD_NEEDED 1

static void new_head_lock_in_child(void) {
    /* The new lock comes from the default raw allocator, as in the fixed releases: an allocator hooked
     * in its place (tracemalloc's) takes the GIL, which in the child of a fork made by a C thread
     * belongs to a thread that does not exist there. On failure the lock stays as it was: the child
     * is no worse off than without the guard. */
    PyMemAllocatorEx hooked;
    _PyMem_SetDefaultAllocator(PYMEM_DOMAIN_RAW, &hooked);
    (void)_PyThread_at_fork_reinit(&_PyRuntime.interpreters.mutex);
    PyMem_SetAllocator(PYMEM_DOMAIN_RAW, &hooked);
}
#endif

#ifdef FORK_GUARD_NEEDED
static int installed = 0;
#endif

static PyObject *install(PyObject *self, PyObject *unused) {
#ifdef FORK_GUARD_NEEDED
    if (!installed) {
        int error = pthread_atfork(NULL, NULL, new_head_lock_in_child);
        if (error != 0) {
            errno = error;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        installed = 1;
    }
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS,
     "Register the child-side reset of the interpreter-list lock for every later fork of this process "
     "(once); True where this build has it (CPython 3.10 and 3.11), else False."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fork_guard", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fork_guard(void) { return PyModule_Create(&module); }
