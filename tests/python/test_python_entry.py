"""The operator library's Python entry (torch_binding/ops_python.cpp), which the module calls:
the same call as the boxed torch.ops operator, or handed to it (tensor subclasses, torch function
modes, arguments it does not read itself); how it is found, opened and declined; what the entry
and the operator library take from Python; and errors, modes and the GIL through it."""

import os
import re
import sys
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fastaxial
from conftest import make_pair, randomize_, run_python


# ---- the operator library's Python entry (torch_binding/ops_python.cpp) ------------------------
# The module calls fastaxial.module._CALL: the entry where the library has one, which makes the
# boxed operator's call (_OP) through the typed dispatcher handle and hands it every call it does not
# serve itself. Each test below compares it with _OP, or watches what it hands over.

_OP = fastaxial.module._OP
ENTRY_DISABLED = os.environ.get("FASTAXIAL_PYTHON_ENTRY") == "0"


def _recording_entry():
    """A second entry whose fallback records each call it is handed, then makes it through _OP."""
    handed = []

    def fallback(*args, **kwargs):
        handed.append((args, kwargs))
        return _OP(*args, **kwargs)

    entry = fastaxial.ops.python_entry(fallback)
    if entry is None:
        pytest.skip("the operator library has no Python entry here")
    return entry, handed


def _call_args(device, D=32, heads=4, H=3, W=5, seed=12, requires_grad=False):
    ref, new = make_pair(D, heads, H, W, device, seed=seed)
    randomize_(ref, seed)
    new.load_state_dict(ref.state_dict())
    x = torch.randn(2, H, W, D, device=device)
    weights = [w.detach().clone().requires_grad_(requires_grad) for w in new.weights()]
    return [x.requires_grad_(requires_grad), *weights, heads, 1e-5, 0.0]


def test_the_module_calls_the_entry_where_the_library_has_one():
    """The library's build record says whether the build made the entry, _python_entry.so beside _C.so;
    the module then calls it."""
    info = fastaxial.ops._build_info(fastaxial.ops.library_path())
    if info is None:
        pytest.skip("the operator library has no build record beside it")
    built = info["PYTHON_ENTRY"]
    assert fastaxial.ops.python_entry_path().exists() == bool(built)
    if ENTRY_DISABLED or (built and built != fastaxial.ops._python_abi()):
        assert fastaxial.module._CALL is _OP
    else:
        assert (fastaxial.module._CALL is not _OP) == bool(built)
        if built:
            assert type(fastaxial.module._CALL).__name__ == "builtin_function_or_method"


def test_the_record_names_the_entrys_abi():
    """_build_info.PYTHON_ENTRY, which decides whether the entry is opened, is the ABI the entry was
    compiled for ("3.13t" for a free-threaded Python, as fastaxial_python_abi() says)."""
    import ctypes

    info = fastaxial.ops._build_info(fastaxial.ops.library_path())
    path = fastaxial.ops.python_entry_path()
    if info is None or not path.exists():
        pytest.skip("no build record, or no entry library")
    abi = ctypes.PyDLL(str(path)).fastaxial_python_abi
    abi.restype = ctypes.c_char_p
    assert abi().decode() == info["PYTHON_ENTRY"]


def test_no_entry_under_another_python(monkeypatch):
    """The entry, compiled against one Python's headers, is taken only under that one: the record says
    so before the library is opened, and without a record the library itself."""
    _recording_entry()  # skips where there is no entry at all
    monkeypatch.setattr(fastaxial.ops, "_python_abi", lambda: "3.99t")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # declined, not failed
        assert fastaxial.ops.python_entry() is None
        monkeypatch.setattr(fastaxial.ops, "_build_info", lambda path: None)
        assert fastaxial.ops.python_entry() is None


class _FakeFunction:
    def __init__(self, fn):
        self.fn, self.restype, self.argtypes = fn, None, None

    def __call__(self, *args):
        return self.fn(*args)


class _FakeEntryLibrary:
    """What ctypes.PyDLL gives for an entry library whose factory fails as the C++ one can."""
    failure = None

    def __init__(self, path):
        if self.failure == "open":
            raise OSError(f"{path}: cannot open shared object file")
        self.fastaxial_python_abi = _FakeFunction(lambda: fastaxial.ops._python_abi().encode())
        if self.failure != "symbol":
            self.fastaxial_python_entry = _FakeFunction(self.make)

    def make(self, fallback):
        if self.failure == "schema":  # findSchemaOrThrow, translated to Python
            raise RuntimeError("Could not find schema for fastaxial::axial_attention")
        if self.failure == "signature":  # typed<>()
            raise RuntimeError("Tried to access or call an operator with a wrong signature")
        return None  # a NULL without an error set


@pytest.mark.parametrize("failure", ["open", "symbol", "schema", "signature", "none"])
def test_a_failing_entry_costs_the_entry_with_a_warning(monkeypatch, failure):
    """Whatever goes wrong in opening the entry library or in its factory, python_entry() warns and
    returns None, and the module calls the boxed operator: the import never fails for it."""
    import ctypes

    monkeypatch.delenv("FASTAXIAL_PYTHON_ENTRY", raising=False)
    monkeypatch.setattr(fastaxial.ops, "python_entry_path", lambda: fastaxial.ops.library_path())  # a file
    monkeypatch.setattr(fastaxial.ops, "_build_info", lambda path: None)
    monkeypatch.setattr(_FakeEntryLibrary, "failure", failure)
    monkeypatch.setattr(ctypes, "PyDLL", _FakeEntryLibrary)
    with pytest.warns(UserWarning, match="Python entry .* is unusable"):
        assert fastaxial.ops.python_entry() is None


@pytest.mark.parametrize("what", ["the operator library", "not a library"])
def test_an_entry_library_that_is_no_entry_gives_a_warning(monkeypatch, tmp_path, what):
    """A real file where the entry should be: a library without its symbols (_C.so), or no library."""
    monkeypatch.delenv("FASTAXIAL_PYTHON_ENTRY", raising=False)
    path = fastaxial.ops.library_path()
    if what == "not a library":
        path = tmp_path / "_python_entry.so"
        path.write_text("not an ELF file")
    monkeypatch.setattr(fastaxial.ops, "python_entry_path", lambda: path)
    monkeypatch.setattr(fastaxial.ops, "_build_info", lambda path: None)
    with pytest.warns(UserWarning, match="Python entry .* is unusable"):
        assert fastaxial.ops.python_entry() is None


def test_entry_factory_before_the_operator_exists_raises_then_works():
    """The factory asks the dispatcher for the operator, which _C.so registers: before _C.so is loaded it
    raises a Python error (not a crash), and the failed lookup leaves nothing behind: once _C.so is loaded
    the same factory works."""
    entry_path = fastaxial.ops.python_entry_path()
    if not entry_path.exists():
        pytest.skip("the operator library has no Python entry here")
    script = f"""
import ctypes, torch
lib = ctypes.PyDLL({str(entry_path)!r})
make = lib.fastaxial_python_entry
make.restype, make.argtypes = ctypes.py_object, [ctypes.py_object]
try:
    make(None)
except RuntimeError as e:
    assert "fastaxial::axial_attention" in str(e), e
else:
    raise AssertionError("made an entry without the operator")
torch.ops.load_library({str(fastaxial.ops.library_path())!r})
entry = make(None)
assert type(entry).__name__ == "builtin_function_or_method"
print("ok")
"""
    r = run_python(script)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("beside", ["the entry", "nothing", "a broken entry"])
def test_entry_beside_a_library_named_by_fastaxial_library(tmp_path, beside):
    """FASTAXIAL_LIBRARY=/elsewhere/_C.so: the entry is /elsewhere/_python_entry.so, where there is one; a
    broken one costs the entry with a warning, never the import."""
    entry_path = fastaxial.ops.python_entry_path()
    if beside == "the entry" and not entry_path.exists():
        pytest.skip("the operator library has no Python entry here")
    (tmp_path / "_C.so").symlink_to(fastaxial.ops.library_path())  # no build record beside it
    if beside == "the entry":
        (tmp_path / "_python_entry.so").symlink_to(entry_path)
    elif beside == "a broken entry":
        (tmp_path / "_python_entry.so").write_text("not an ELF file")
    script = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import torch, fastaxial
m = fastaxial.AxialAttention(8, 2, 1, 1)
with torch.no_grad():
    assert m(torch.randn(1, 1, 1, 8)).shape == (1, 1, 1, 8)
messages = [str(w.message) for w in caught if "fastaxial" in str(w.message)]
print(fastaxial.module._CALL is not fastaxial.module._OP, messages)
"""
    r = run_python(script, FASTAXIAL_LIBRARY=str(tmp_path / "_C.so"), FASTAXIAL_PYTHON_ENTRY="1")
    assert r.returncode == 0, r.stderr
    entry_used, messages = r.stdout.strip().split(" ", 1)
    assert entry_used == str(beside == "the entry"), r.stdout
    if beside == "a broken entry":
        assert "Python entry" in messages and "unusable" in messages, messages
    else:
        assert messages == "[]", messages


def _needed(path):
    import subprocess

    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def _undefined_python_symbols(path):
    import subprocess

    out = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {m.group(1) for m in re.finditer(r"\bU (_?Py\w+)", out)}


def test_operator_library_needs_no_python():
    """_C.so serves C++ programs without Python too (a traced model run through libtorch loads it with
    dlopen): it neither needs libpython nor libtorch_python, nor takes any Python symbol, and a process
    without Python loads it, binding every symbol (its registrations run there too)."""
    import shutil
    import subprocess

    if shutil.which("readelf") is None or shutil.which("nm") is None:
        pytest.skip("needs readelf and nm")
    lib = fastaxial.ops.library_path()
    needed = _needed(lib)
    assert "libtorch_cpu.so" in needed, needed
    assert not [n for n in needed if n.startswith(("libpython", "libtorch_python"))], needed
    assert not _undefined_python_symbols(lib)
    true = shutil.which("true")
    # torch's libraries on the search path, as a libtorch program has them (an installed wheel's _C.so
    # finds them beside it, in site-packages, which a copy elsewhere would not).
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    search = os.pathsep.join(p for p in (torch_lib, os.environ.get("LD_LIBRARY_PATH")) if p)

    def load_without_python(path):
        env = dict(os.environ, LD_PRELOAD=str(path), LD_BIND_NOW="1", LD_LIBRARY_PATH=search)
        return subprocess.run([true], env=env, capture_output=True, text=True, timeout=120)

    r = load_without_python(lib)
    assert r.returncode == 0 and not r.stderr, r.stderr
    entry = fastaxial.ops.python_entry_path()
    if entry.exists():  # the check tells: the entry library, which needs Python, does not load there
        r = load_without_python(entry)
        assert r.returncode != 0 and "undefined symbol: Py" in r.stderr, (r.returncode, r.stderr)


# What the entry library takes from Python: functions of every Python 3 the package supports (3.10
# on), so that a GIL build of it opens (ctypes binds each symbol at load) under any of them, and says
# through fastaxial_python_abi() whether it is theirs. A new one here must be in all of them (private
# _Py* names and PyObject_Vectorcall are not).
PYTHON_SYMBOLS = {"PyCMethod_New", "PyDict_New", "PyDict_SetItem", "PyErr_Clear", "PyErr_Occurred",
                  "PyEval_RestoreThread", "PyEval_SaveThread", "PyFloat_Type", "PyLong_AsDouble",
                  "PyLong_AsLongLongAndOverflow", "PyLong_Type", "PyObject_VectorcallDict", "_Py_Dealloc"}


def test_entry_library_takes_only_portable_python_symbols():
    import shutil
    import sysconfig

    if shutil.which("nm") is None:
        pytest.skip("needs nm")
    entry = fastaxial.ops.python_entry_path()
    if not entry.exists():
        pytest.skip("the operator library has no Python entry here")
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        pytest.skip("a free-threaded build's entry takes that ABI's own reference counting; it opens only there")
    taken = _undefined_python_symbols(entry)
    assert taken <= PYTHON_SYMBOLS, sorted(taken - PYTHON_SYMBOLS)
    needed = _needed(entry)
    assert "libtorch_python.so" in needed and not [n for n in needed if n.startswith("libpython")], needed


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_entry_matches_the_boxed_operator_bitwise(device, mode):
    entry, handed = _recording_entry()
    grad = mode == "grad"
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}[mode]
    a = _call_args(device, requires_grad=grad)
    b = [t.detach().clone().requires_grad_(grad) if isinstance(t, torch.Tensor) else t for t in a]
    with ctx():
        got, want = entry(*a), _OP(*b)
    assert not handed, "the entry handed a plain call to the boxed operator"
    assert torch.equal(got, want)
    assert got.is_inference() == want.is_inference() == (mode == "inference_mode")
    assert got.requires_grad == want.requires_grad == grad
    if grad:
        assert got.grad_fn.name() == want.grad_fn.name()
        g = torch.randn_like(got)
        got.backward(g)
        want.backward(g)
        for i, (s, t) in enumerate(zip(a[:11], b[:11])):
            assert torch.equal(s.grad, t.grad), i


@pytest.mark.skipif(not fastaxial.ops.dropout_available(), reason="built without attention dropout")
def test_entry_with_dropout_draws_the_boxed_operators_mask(device):
    entry, handed = _recording_entry()
    a = _call_args(device, requires_grad=True)
    a[13] = 0.3
    b = [t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in a]
    torch.manual_seed(5)
    got = entry(*a)
    torch.manual_seed(5)
    want = _OP(*b)
    assert not handed
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    got.backward(g)
    want.backward(g)
    assert all(torch.equal(s.grad, t.grad) for s, t in zip(a[:11], b[:11]))


class _Traced(torch.Tensor):
    """A tensor subclass that records the functions its __torch_function__ sees."""
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("where", [0, 4, 10])  # x, a row weight, the last weight
def test_tensor_subclass_reaches_its_torch_function(device, where):
    entry, handed = _recording_entry()
    a = _call_args(device)
    want = _OP(*a)
    a[where] = a[where].as_subclass(_Traced)
    _Traced.seen.clear()
    got = entry(*a)
    assert len(handed) == 1
    assert torch.ops.fastaxial.axial_attention.default in _Traced.seen
    assert type(got) is _Traced and torch.equal(got.as_subclass(torch.Tensor), want)


def test_tensor_subclass_through_the_module(device):
    _, new = make_pair(32, 4, 3, 5, device, seed=13)
    x = torch.randn(2, 3, 5, 32, device=device)
    with torch.no_grad():
        want = new(x)
        _Traced.seen.clear()
        got = new(x.as_subclass(_Traced))
    assert torch.ops.fastaxial.axial_attention.default in _Traced.seen
    assert torch.equal(got.as_subclass(torch.Tensor), want)


class _Records:
    """Mixed into a torch function or dispatch mode: records each op the mode sees, then runs it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _record(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _RefuseTheOperator(TorchDispatchMode):
    """Raises a KeyError where the operator reaches the dispatcher; counts those calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.fastaxial.axial_attention.default:
            self.calls += 1
            raise KeyError("refused by the mode")
        return func(*args, **(kwargs or {}))


def _mode_sees_the_call(mode_type, device, seed):
    """The entry's call and a module's call under a recording mode of mode_type: both show the operator
    to the mode, the entry's result equals the boxed operator's. Returns the calls the entry handed to
    the boxed operator."""
    entry, handed = _recording_entry()
    a = _call_args(device)
    with mode_type() as mode:
        got = entry(*a)
    assert torch.ops.fastaxial.axial_attention.default in mode.seen
    assert torch.equal(got, _OP(*a))
    _, new = make_pair(32, 4, 3, 5, device, seed=seed)
    with torch.no_grad(), mode_type() as mode:
        new(torch.randn(1, 3, 5, 32, device=device))
    assert torch.ops.fastaxial.axial_attention.default in mode.seen
    return len(handed)


def test_torch_function_mode_sees_the_call(device):
    class Record(_Records, TorchFunctionMode):
        __torch_function__ = _Records._record

    assert _mode_sees_the_call(Record, device, seed=14) == 1  # a function mode: the entry hands the call over


def test_torch_dispatch_mode_sees_the_call_on_the_fast_path(device):
    class Record(_Records, TorchDispatchMode):
        __torch_dispatch__ = _Records._record

    # a dispatch mode sits in the dispatcher: the typed call reaches it
    assert _mode_sees_the_call(Record, device, seed=15) == 0


def test_exception_from_a_dispatch_mode_comes_through(device):
    entry, _ = _recording_entry()
    a = _call_args(device)
    with _RefuseTheOperator(), pytest.raises(KeyError, match="refused by the mode"):
        entry(*a)


def test_fake_tensor_mode_and_profiler(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    entry, handed = _recording_entry()
    a = _call_args(device)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = entry(*a)
    assert type(out).__name__ == "FakeTensor" and out.shape == a[0].shape
    with torch.autograd.profiler.profile() as prof:
        entry(*a)
    assert not handed
    assert any(e.name == "fastaxial::axial_attention" for e in prof.function_events)


def _bad_calls(device):
    """(name, arguments, keyword arguments): calls the operator refuses, on the entry's own path (the
    kernels' checks) and on the calls it hands to the boxed operator (argument parsing)."""
    a = _call_args(device)

    def but(**changes):
        b = list(a)
        for i, v in changes.items():
            b[int(i[1:])] = v
        return b

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # named tensors are experimental, torch says
        named = a[0].detach().clone().refine_names("B", "H", "W", "D")
    return [
        ("rank", but(i0=a[0][0]), {}),
        ("heads 0", but(i11=0), {}),
        ("heads 5", but(i11=5), {}),
        ("heads too large", but(i11=2**70), {}),
        ("heads a float", but(i11=4.0), {}),
        ("heads a string", but(i11="4"), {}),
        ("x float64", but(i0=a[0].double()), {}),
        ("weight shape", but(i3=a[3][..., :-1]), {}),
        ("weight dtype", but(i9=a[9].double()), {}),
        ("eps negative", but(i12=-1.0), {}),
        ("eps too large an int", but(i12=10**400), {}),
        ("eps a string", but(i12="1e-5"), {}),
        ("dropout above 1", but(i13=1.5), {}),
        ("a weight None", but(i5=None), {}),
        ("x a list", but(i0=[1.0]), {}),
        ("named x", but(i0=named), {}),
        ("13 arguments", a[:13], {}),  # dropout has a default: not an error
        ("12 arguments", a[:12], {}),
        ("11 arguments", a[:11], {}),
        ("16 arguments", a + [None, 1], {}),
        ("unknown keyword", a, {"bogus": 1}),
        ("rng_state wrong", a, {"rng_state": torch.zeros(3, dtype=torch.int64, device=device)}),
    ]


BAD_CALLS = ("rank", "heads 0", "heads 5", "heads too large", "heads a float", "heads a string", "x float64",
             "weight shape", "weight dtype", "eps negative", "eps too large an int", "eps a string",
             "dropout above 1", "a weight None", "x a list", "named x", "13 arguments", "12 arguments",
             "11 arguments", "16 arguments", "unknown keyword", "rng_state wrong")


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_input_raises_what_the_boxed_operator_raises(device, name):
    entry, _ = _recording_entry()
    calls = {n: (a, k) for n, a, k in _bad_calls(device)}
    assert tuple(calls) == BAD_CALLS
    args, kwargs = calls[name]
    try:
        want = _OP(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the boxed operator raises
        with pytest.raises(type(e)) as got:
            entry(*args, **kwargs)
        assert str(got.value) == str(e), name
    else:  # accepted by both, with the same result
        assert torch.equal(entry(*args, **kwargs), want), name


def test_other_arguments_the_boxed_operator_accepts(device):
    """Arguments it does not read itself (an int eps, a bool heads, rng_state) give _OP's result."""
    entry, handed = _recording_entry()
    a = _call_args(device, heads=1, D=8)
    for changes in ({12: 0}, {13: 0}, {11: True}):  # an int eps and dropout: read as floats
        b = list(a)
        for i, v in changes.items():
            b[i] = v
        assert torch.equal(entry(*b), _OP(*b)), changes
    assert len(handed) == 1  # the bool heads only
    rng = torch.tensor([3, 4], dtype=torch.int64, device=a[0].device)
    assert torch.equal(entry(*a, rng), _OP(*a, rng))
    assert torch.equal(entry(*a, rng_state=rng), _OP(*a, rng_state=rng))
    assert len(handed) == 3


def test_entry_releases_the_gil_while_the_operator_runs(device):
    """As torch.ops does: another Python thread runs while the operator computes. With a switch
    interval far longer than the calls, the waiting thread gets the GIL during them only if a call
    releases it. (The outputs are kept: freeing a tensor releases the GIL too.)"""
    import threading

    entry, _ = _recording_entry()
    a = _call_args(device, D=64, heads=4, H=24, W=24)
    entry(*a)  # warm-up
    go, state, seen = threading.Event(), {"in_call": False}, []
    t = threading.Thread(target=lambda: (go.wait(), seen.append(state["in_call"])))
    t.start()
    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        go.set()
        state["in_call"] = True
        outs = []
        for _ in range(500):  # until the thread has run: it takes a while to wake
            outs.append(entry(*a))
            if seen:
                break
        state["in_call"] = False
        t.join()
        del outs
    finally:
        sys.setswitchinterval(old)
    assert seen == [True]


def test_key_error_from_the_call_is_not_taken_for_a_stale_slot(device):
    """forward() rebuilds its weight slots on a KeyError from a parametrized weight; a KeyError raised by
    the call itself (here by a dispatch mode) propagates after one call, the slots kept."""
    _, new = make_pair(32, 4, 3, 5, device, seed=19)
    x = torch.randn(1, 3, 5, 32, device=device)
    refuse = _RefuseTheOperator()
    with torch.no_grad():
        new(x)  # builds the slots
        slots = new.__dict__["_slots"]
        with refuse, pytest.raises(KeyError, match="refused by the mode"):
            new(x)
    assert refuse.calls == 1 and new.__dict__["_slots"] is slots
