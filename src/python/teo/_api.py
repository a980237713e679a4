"""The model: parameters, batches and one run, as dicts of numpy arrays."""

import numpy as np

from . import _teo
from ._wire import arrays_of


def init_params(cfg, seed, dtype="float64"):
    """The deterministic initialisation of every parameter (the bits of C++ Params::init), by
    its contract name: {"embedding.weight": (V, D) array, "layers.0.attn.q.weight": ...}."""
    return _teo.init_params(cfg, int(seed), str(dtype))


def random_batch(cfg, batch, seq_len, seed, lengths=None):
    """{"tokens" (B, S), "lengths" (B), "labels" (B)}, int64, drawn from seed as C++
    Batch::random draws them; lengths default to seq_len."""
    return _teo.random_batch(cfg, int(batch), int(seq_len), int(seed),
                             None if lengths is None else [int(x) for x in lengths])


def run(cfg, params, batch, *, train=False, dropout_seed=0, masks=None, precision=None,
        backward=True, backend=None, threads=None):
    """Forward (and backward, from the mean loss) on params and batch.

    Returns every act.* tensor of the golden contract, every grad.* tensor when backward is set,
    and the dropout.* masks when train mode applies dropout, as numpy arrays. params are all
    float32 or all float64 (the run's dtype). precision emulates tf32, bf16 or fp16 in a float32
    run. backend ("reference", "simd", "blas") and threads apply to this call only.
    """
    dtypes = {np.asarray(a).dtype for a in params.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (np.float32, np.float64):
        from . import ConfigError
        raise ConfigError("params must be all float32 or all float64 arrays, got %s"
                          % sorted(str(d) for d in dtypes))
    dtype = str(next(iter(dtypes)))
    wire = _teo.run(cfg, params, batch, bool(train), int(dropout_seed), precision, bool(backward),
                    backend, threads, dtype, None if masks is None else dict(masks))
    return arrays_of(wire)
