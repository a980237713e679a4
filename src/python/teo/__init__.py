"""teo: the float64 oracle of the Transformer encoder, with exact backward, its golden files and
its checker, from Python.

    import teo
    cfg = teo.ModelConfig(d_model=16, num_heads=2, num_layers=2)
    params = teo.init_params(cfg, seed=1)
    batch = teo.random_batch(cfg, batch=2, seq_len=8, seed=1)
    out = teo.run(cfg, params, batch)          # {"act.layers.0.probs": ndarray, "grad...": ...}

Tensors are numpy arrays named as in the golden contract (docs/golden-format.md). Errors are
teo.ConfigError, teo.ShapeError, teo.InputError (ValueError), teo.FormatError and teo.FileError
(OSError). The compiled core releases the GIL while it computes.
"""


class Error(Exception):
    """Any error teo reports."""


class ConfigError(Error, ValueError):
    """A bad config key or value, flag or spec; the message names it."""


class ShapeError(Error, ValueError):
    """Sizes that do not fit together, or that would not fit in memory."""


class InputError(Error, ValueError):
    """A token id or label outside its range."""


class RangeError(Error, ValueError):
    """A value that overflowed the emulated format (fp16)."""


class IllConditioned(Error, ValueError):
    """A case whose own error is not at rounding level."""


class FormatError(Error, OSError):
    """A file that is not what it claims (safetensors, golden, op case)."""


class FileError(Error, OSError):
    """A file that cannot be read or written."""


from . import _teo  # noqa: E402  (the exceptions above must exist first: _teo raises them)
from ._teo import ModelConfig  # noqa: E402
from ._api import generate, init_params, random_batch, run  # noqa: E402
from . import golden, ops, testing  # noqa: E402,F401

__version__ = _teo.__version__
EncoderConfig = ModelConfig  # the name it had before its sections
__all__ = ["ModelConfig", "generate", "init_params", "random_batch", "run", "golden", "ops", "testing",
           "Error", "ConfigError", "ShapeError", "InputError", "RangeError", "IllConditioned",
           "FormatError", "FileError"]
