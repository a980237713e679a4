"""Tensors between numpy and the compiled core: (name, dtype, shape, bytes) tuples."""

import numpy as np

try:  # the bfloat16 dtype JAX uses; without it BF16 tensors load as their uint16 bit patterns
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None
    BFLOAT16 = None

_NUMPY = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "I64": np.dtype("<i8"), "U8": np.dtype("u1"), "BF16": np.dtype("<u2"),
          "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1")}


def arrays_of(wire):
    """name -> ndarray from the core's tuples (copies, writable)."""
    out = {}
    for name, dtype, shape, raw in wire:
        a = np.frombuffer(raw, dtype=_NUMPY[dtype]).reshape(shape).copy()
        if dtype == "BF16" and BFLOAT16 is not None:
            a = a.view(BFLOAT16)
        out[name] = a
    return out


def st_dtype(name, a):
    """The safetensors dtype of array a, or ConfigError naming the tensor."""
    from . import ConfigError
    d = a.dtype
    if BFLOAT16 is not None and d == BFLOAT16:
        return "BF16"
    table = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32",
             np.dtype(np.float16): "F16", np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8",
             np.dtype(np.bool_): "U8"}
    if d.newbyteorder("=") in table:
        return table[d.newbyteorder("=")]
    raise ConfigError("tensor %s has dtype %s; teo reads float64, float32, float16, bfloat16 "
                      "(ml_dtypes), int64 and uint8" % (name, d))


def wire_of(tensors, bits=None):
    """The core's tuples from name -> array. bits maps a name to "BF16" or "F16" for uint16
    arrays that hold bit patterns. Any layout is accepted (copied to C order)."""
    from . import ConfigError
    if not isinstance(tensors, dict):
        raise ConfigError("tensors must be a dict of name -> array, got %s"
                          % type(tensors).__name__)
    out = []
    for name, a in tensors.items():
        if not isinstance(name, str):
            raise ConfigError("tensor names must be strings, got %r" % (name,))
        if hasattr(a, "detach"):  # a torch tensor
            a = a.detach().cpu().numpy()
        a = np.asarray(a)
        if bits and name in bits:
            if a.dtype != np.uint16:
                raise ConfigError("tensor %s is declared %s bits but has dtype %s"
                                  % (name, bits[name], a.dtype))
            dtype = bits[name]
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
