"""Values between Python and the compiled core: arrays (numpy, torch, anything np.asarray takes)
as numpy arrays and as (name, dtype, shape, bytes) tuples, spec values as JSON values, and the
check of a public function's keywords."""

import difflib
import os
import sys
import warnings

import numpy as np

try:  # the bfloat16 dtype JAX uses; without it BF16 tensors load as their uint16 bit patterns
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None
    BFLOAT16 = None

_NUMPY = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
          "BF16": np.dtype("<u2"),
          "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1")}

_bf16_warned = False  # the warning that BF16 loads as uint16 is given once per process


def is_torch(a):
    """Whether a is a torch tensor (torch is not imported to find out)."""
    return type(a).__module__.startswith("torch") and hasattr(a, "detach")


def is_bf16_bits(a):
    """Whether as_array(a) gives uint16 bit patterns of bfloat16: a torch bfloat16 tensor where
    ml_dtypes is not installed."""
    return BFLOAT16 is None and is_torch(a) and str(a.dtype) == "torch.bfloat16"


def as_array(a):
    """a as a numpy array, the one conversion every entry point of teo makes. A torch tensor is
    detached (requires_grad is fine) and moved to the CPU; bfloat16 becomes ml_dtypes.bfloat16,
    or its uint16 bit patterns where ml_dtypes is not installed (is_bf16_bits says so), float16
    numpy.float16. Anything else goes through np.asarray (lists, scalars, numpy arrays)."""
    if not is_torch(a):
        return np.asarray(a)
    torch = sys.modules["torch"]
    t = a.detach().cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.dtype == torch.bfloat16:
        bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
        return bits if BFLOAT16 is None else bits.view(BFLOAT16)
    return t.numpy()


def real_array(a, name, what):
    """as_array(a) for an entry point that computes on it (teo.run, teo.ops): a bfloat16 or
    float16 array is a ConfigError naming it, with the way to emulate that format instead."""
    from . import ConfigError
    x = as_array(a)
    bf16 = is_bf16_bits(a) or (BFLOAT16 is not None and x.dtype == BFLOAT16)
    if bf16 or x.dtype == np.float16:
        kind = "bfloat16" if bf16 else "float16"
        raise ConfigError(
            "%s is %s; %s computes in float32 or float64: pass it as float32 (torch: .float()) "
            "with precision=\"%s\" to emulate %s" % (name, kind, what,
                                                     "fp16" if kind == "float16" else "bf16",
                                                     kind))
    return x


def json_value(v):
    """v with numpy arrays and scalars and torch tensors made lists and Python scalars, in lists,
    tuples and dicts too, so that json.dumps takes it (an op spec)."""
    if isinstance(v, dict):
        return {k: json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if is_torch(v) or isinstance(v, (np.ndarray, np.generic)):
        return as_array(v).tolist()
    return v


def check_keywords(function, given, valid):
    """TypeError naming the public function (e.g. "teo.ops.attention") for the first keyword of
    given that is not in valid, with the closest valid keyword."""
    for key in given:
        if key not in valid:
            close = (difflib.get_close_matches(key, list(valid), n=1)
                     or [v for v in valid if key in v.split("_")][:1])  # "eps": layer_norm_eps
            raise TypeError("%s() got an unexpected keyword argument %r%s" % (
                function, key, "; did you mean %r?" % close[0] if close else ""))


def backend_of(backend):
    """The backend a call runs on: backend when given, else the TEO_BACKEND environment
    variable's (as the teo command reads it), else None (the process's: reference)."""
    if backend is not None or not os.environ.get("TEO_BACKEND"):
        return backend
    value = os.environ["TEO_BACKEND"]
    if value not in ("reference", "simd", "blas"):
        from . import ConfigError
        raise ConfigError("TEO_BACKEND must be reference, simd or blas, got %r" % value)
    return value


def _outside_teo():
    """The stacklevel of a warning given here that points at the first caller outside teo."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "teo":
        level, frame = level + 1, frame.f_back
    return level


def arrays_of(wire):
    """name -> ndarray from the core's tuples (copies, writable). BF16 is ml_dtypes.bfloat16, or
    uint16 bit patterns (with a warning, once) where ml_dtypes is not installed."""
    global _bf16_warned
    out = {}
    for name, dtype, shape, raw in wire:
        a = np.frombuffer(raw, dtype=_NUMPY[dtype]).reshape(shape).copy()
        if dtype == "BF16":
            if BFLOAT16 is not None:
                a = a.view(BFLOAT16)
            elif not _bf16_warned:
                _bf16_warned = True
                warnings.warn("teo: BF16 tensors (%s) load as uint16 bit patterns because "
                              "ml_dtypes is not installed; pip install \"ml_dtypes<0.5\" to get "
                              "them as ml_dtypes.bfloat16" % name, stacklevel=_outside_teo())
        out[name] = a
    return out


def bits_of(wire):
    """name -> dtype for the tensors of the core's tuples that arrays_of gives as bit patterns:
    F8_E4M3 and F8_E5M2 (uint8: a quantized weight's scales, a quantized cache), and BF16 (uint16)
    where ml_dtypes is not installed. The bits= that writes them back in their dtypes."""
    out = {name: dtype for name, dtype, _, _ in wire if dtype in ("F8_E4M3", "F8_E5M2")}
    if BFLOAT16 is None:
        out.update({name: "BF16" for name, dtype, _, _ in wire if dtype == "BF16"})
    return out


def st_dtype(name, a):
    """The safetensors dtype of array a, or ConfigError naming the tensor."""
    from . import ConfigError
    d = a.dtype
    if BFLOAT16 is not None and d == BFLOAT16:
        return "BF16"
    table = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32",
             np.dtype(np.float16): "F16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
             np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
             np.dtype(np.bool_): "U8"}
    if d.newbyteorder("=") in table:
        return table[d.newbyteorder("=")]
    raise ConfigError("tensor %s has dtype %s; teo reads float64, float32, float16, bfloat16 "
                      "(ml_dtypes or torch), int64, int32, int8 and uint8" % (name, d))


def wire_of(tensors, bits=None):
    """The core's tuples from name -> array (numpy, torch of any float dtype, ...; see as_array).
    bits maps a name to "BF16" or "F16" for uint16 arrays that hold bit patterns, or to "F8_E4M3"
    or "F8_E5M2" for uint8 ones; a torch bfloat16 tensor needs none. Any layout is accepted
    (copied to C order)."""
    from . import ConfigError
    if not isinstance(tensors, dict):
        raise ConfigError("tensors must be a dict of name -> array, got %s"
                          % type(tensors).__name__)
    out = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise ConfigError("tensor names must be strings, got %r" % (name,))
        a = as_array(t)
        if bits and name in bits:
            if a.dtype != (np.uint8 if bits[name].startswith("F8") else np.uint16):
                raise ConfigError("tensor %s is declared %s bits but has dtype %s"
                                  % (name, bits[name], a.dtype))
            dtype = bits[name]
        elif is_bf16_bits(t):
            dtype = "BF16"
        elif a.dtype == np.uint16:
            raise ConfigError("tensor %s is uint16: pass bits={%r: 'BF16' or 'F16'} to say "
                              "which bit patterns it holds" % (name, name))
        else:
            dtype = st_dtype(name, a)
        # (np.ascontiguousarray would make a 0-d array 1-d)
        c = a if a.flags.c_contiguous else np.array(a, order="C")
        if c.dtype == np.bool_:
            c = c.astype(np.uint8)
        c = c.astype(c.dtype.newbyteorder("<"), copy=False)
        out.append((name, dtype, [int(s) for s in c.shape], c.tobytes()))
    return out
