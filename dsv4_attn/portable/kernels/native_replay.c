/* A bound layer call's launches, repeated in one C call (launch.Replay): its guards, then each
 * launch, the driver's directly. native_replay.py builds this file with Triton's own C build, as
 * Triton builds its launchers.
 *
 * replay(driver, launches, start, guards) -> None | False | (index, CUresult)
 *
 *   driver    the address of libcuda's cuLaunchKernelEx (or a stand-in of its signature)
 *   launches  a tuple; each item either a tuple (callable, args), called as callable(*args)
 *             (Triton's launcher for a kernel the driver is not handed directly), or an object
 *             whose `address` is that of a `struct direct_launch` (cuLaunchKernelEx's
 *             configuration and CUfunction, the parameter block: one 8-byte slot per parameter,
 *             whose addresses are handed to the driver) in memory it owns: the tuple keeps it
 *             alive while the GIL is released around the driver call
 *   start     the first item to launch
 *   guards    None (launch without asking), or the tuple
 *             (runtime, stream_of, device_index, stream, stream_is_capturing, current_device, gpu):
 *             nothing is launched (the result is False) when Triton's `runtime` knobs hold a
 *             launch enter or exit hook, stream_of(device_index) != stream, the driver's
 *             cuStreamIsCapturing (its address: `stream_is_capturing`, 0 for none) says a capture
 *             is in progress on `stream` or fails, or gpu is not None and current_device() != gpu
 *
 * The result: None when every item from `start` launched; False when a guard refused; (index,
 * code) when the driver refused item `index` with CUresult `code` (the items before it launched,
 * the ones after it not). A Python exception raised by a guard or a launcher propagates.
 *
 * Why C: a repeated layer call costs 2.1-3.8 us less host time than with the same guards and
 * cuLaunchKernelEx through ctypes, in Python, on a GPU machine's CPU (notes/host-time.md); the
 * driver call itself is the same. The GIL is released around each driver call, as Triton's
 * launcher and ctypes release it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef int (*launch_kernel_ex_fn)(const void *config, void *function, void **params, void **extra);
typedef int (*stream_is_capturing_fn)(void *stream, int *status); /* status 0: CU_STREAM_CAPTURE_STATUS_NONE */

struct direct_launch {
  const void *config; /* CUlaunchConfig * */
  void *function;     /* CUfunction */
  char *block;        /* the parameters, one 8-byte slot each */
  long long params;   /* how many (at most MAX_PARAMS) */
};

#define MAX_PARAMS 1024

static PyObject *enter_hook_name, *exit_hook_name, *calls_name, *address_name;

/* 1 when the hook chain `name` of `runtime` has a hook, 0 when not, -1 on an exception */
static int hook_installed(PyObject *runtime, PyObject *name) {
  PyObject *chain = PyObject_GetAttr(runtime, name);
  if (chain == NULL) return -1;
  PyObject *calls = PyObject_GetAttr(chain, calls_name);
  Py_DECREF(chain);
  if (calls == NULL) return -1;
  int installed = PyObject_IsTrue(calls);
  Py_DECREF(calls);
  return installed;
}

/* 1 when fn(*args) == want, 0 when not, -1 on an exception */
static int returns(PyObject *fn, PyObject *arg, PyObject *want) {
  PyObject *got = arg == NULL ? PyObject_CallNoArgs(fn) : PyObject_CallOneArg(fn, arg);
  if (got == NULL) return -1;
  int equal = PyObject_RichCompareBool(got, want, Py_EQ);
  Py_DECREF(got);
  return equal;
}

/* 1 when no capture is in progress on `stream` (or no query is given), 0 when one is or the query
 * fails (a legacy-stream query while another stream captures), -1 on an exception */
static int not_capturing(PyObject *query, PyObject *stream) {
  stream_is_capturing_fn is_capturing = (stream_is_capturing_fn)PyLong_AsVoidPtr(query);
  void *handle = PyLong_AsVoidPtr(stream);
  if (PyErr_Occurred()) return -1;
  int status = 0;
  return is_capturing == NULL || (is_capturing(handle, &status) == 0 && status == 0);
}

/* 1 when every guard passes, 0 when one refuses, -1 on an exception */
static int guards_pass(PyObject *guards) {
  PyObject *runtime, *stream_of, *device_index, *stream, *capture_query, *current_device, *gpu;
  if (!PyArg_UnpackTuple(guards, "guards", 7, 7, &runtime, &stream_of, &device_index, &stream, &capture_query,
                         &current_device, &gpu))
    return -1;
  int r = hook_installed(runtime, enter_hook_name);
  if (r != 0) return r < 0 ? -1 : 0;
  if ((r = hook_installed(runtime, exit_hook_name)) != 0) return r < 0 ? -1 : 0;
  if ((r = returns(stream_of, device_index, stream)) != 1) return r;
  if ((r = not_capturing(capture_query, stream)) != 1) return r;
  if (gpu != Py_None && (r = returns(current_device, NULL, gpu)) != 1) return r;
  return 1;
}

/* the driver's CUresult, or -1 with an exception (no driver, no `address`, a bad count) */
static int launch_direct(launch_kernel_ex_fn driver, PyObject *item) {
  if (driver == NULL) {
    PyErr_SetString(PyExc_ValueError, "a direct launch with no driver (its address is 0)");
    return -1;
  }
  PyObject *address = PyObject_GetAttr(item, address_name);
  if (address == NULL) return -1;
  const struct direct_launch *d = (const struct direct_launch *)PyLong_AsVoidPtr(address);
  Py_DECREF(address);
  if (PyErr_Occurred()) return -1;
  if (d->params < 0 || d->params > MAX_PARAMS) {
    PyErr_Format(PyExc_ValueError, "a direct launch of %lld parameters; allowed: 0 to %d", d->params, MAX_PARAMS);
    return -1;
  }
  void *params[MAX_PARAMS]; /* each parameter's address: its slot */
  for (long long i = 0; i < d->params; i++) params[i] = d->block + 8 * i;
  int code;
  Py_BEGIN_ALLOW_THREADS
  code = driver(d->config, d->function, params, NULL);
  Py_END_ALLOW_THREADS
  return code;
}

/* 0 when launched through the item's callable, -1 on an exception */
static int launch_python(PyObject *item) {
  PyObject *fn, *args;
  if (!PyArg_UnpackTuple(item, "launch", 2, 2, &fn, &args)) return -1;
  PyObject *result = PyObject_Call(fn, args, NULL);
  if (result == NULL) return -1;
  Py_DECREF(result);
  return 0;
}

static PyObject *replay(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "replay(driver, launches: tuple, start, guards)");
    return NULL;
  }
  launch_kernel_ex_fn driver = (launch_kernel_ex_fn)PyLong_AsVoidPtr(args[0]);
  Py_ssize_t start = PyLong_AsSsize_t(args[2]);
  if (PyErr_Occurred()) return NULL;
  if (args[3] != Py_None) {
    int pass = guards_pass(args[3]);
    if (pass < 0) return NULL;
    if (pass == 0) Py_RETURN_FALSE;
  }
  PyObject *launches = args[1];
  for (Py_ssize_t i = start; i < PyTuple_GET_SIZE(launches); i++) {
    PyObject *item = PyTuple_GET_ITEM(launches, i);
    if (PyTuple_Check(item)) {
      if (launch_python(item) < 0) return NULL;
      continue;
    }
    int code = launch_direct(driver, item);
    if (code < 0) return NULL;
    if (code > 0) return Py_BuildValue("(ni)", i, code);
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"replay", (PyCFunction)(void (*)(void))replay, METH_FASTCALL,
     "replay(driver, launches, start, guards) -> None | False | (index, CUresult)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dsv4_attn_native_replay", NULL, -1, methods};

PyMODINIT_FUNC PyInit_dsv4_attn_native_replay(void) {
  enter_hook_name = PyUnicode_InternFromString("launch_enter_hook");
  exit_hook_name = PyUnicode_InternFromString("launch_exit_hook");
  calls_name = PyUnicode_InternFromString("calls");
  address_name = PyUnicode_InternFromString("address");
  if (enter_hook_name == NULL || exit_hook_name == NULL || calls_name == NULL || address_name == NULL) return NULL;
  return PyModule_Create(&module);
}
