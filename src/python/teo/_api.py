"""The model: parameters, batches and one run, as dicts of numpy arrays."""

import json

import numpy as np

from . import _teo
from ._wire import arrays_of, as_array, backend_of, real_array

_BATCH_KEYS = ("tokens", "lengths", "labels", "token_types", "pixels",
               "src_tokens", "src_lengths", "tgt_tokens", "tgt_lengths")  # an encoder_decoder's


def config_of(cfg):
    """cfg as a teo.ModelConfig: one as it is, a dict of its keys or JSON text converted (a bad
    key or value is a ConfigError naming it)."""
    if isinstance(cfg, _teo.ModelConfig):
        return cfg
    if isinstance(cfg, (dict, str)):
        return _teo.ModelConfig.from_json(cfg)
    raise TypeError("cfg must be a teo.ModelConfig, a dict of its keys or JSON text, got %s"
                    % type(cfg).__name__)


def init_params(cfg, seed, dtype="float64"):
    """The deterministic initialisation of every parameter (the bits of C++ Params::init), by
    its contract name: {"embedding.weight": (V, D) array, "layers.0.attn.q.weight": ...}.
    cfg: a teo.ModelConfig or a dict of its keys."""
    return _teo.init_params(config_of(cfg), int(seed), str(dtype))


def random_batch(cfg, batch, seq_len, seed, lengths=None, tgt_len=0, tgt_lengths=None):
    """{"tokens" (B, S), "lengths" (B), "labels" (B)}, int64, drawn from seed as C++
    Batch::random draws them; lengths default to seq_len; with type_vocab_size also
    "token_types" (B, S). With input "patches": {"pixels" (B, channels, image_size, image_size)
    float64, multiples of 2^-8 in [-1, 1), "lengths", "labels"}, seq_len 1 + patches. An
    encoder_decoder's (give tgt_len):
    {"src_tokens" (B, S), "src_lengths", "tgt_tokens" (B, tgt_len), "tgt_lengths"}, as
    Batch::random_seq2seq draws them."""
    def ints(v):
        return None if v is None else [int(x) for x in as_array(v).reshape(-1)]
    return _teo.random_batch(config_of(cfg), int(batch), int(seq_len), int(seed), ints(lengths),
                             int(tgt_len), ints(tgt_lengths))


def _golden_names(params, batch, masks):
    """ConfigError for a golden's prefixed names, which teo.run takes without the prefix."""
    from . import ConfigError
    for name in params:
        if isinstance(name, str) and name.startswith("param."):
            raise ConfigError(
                "params has \"%s\": teo.run names parameters without the \"param.\" prefix "
                "(\"%s\"); Golden.params() gives a golden's parameters so" % (name, name[6:]))
    for name in batch:
        if isinstance(name, str) and name.startswith("input.") and name[6:] not in batch:
            raise ConfigError(
                "batch has \"%s\": teo.run takes the batch as {\"tokens\", \"lengths\", "
                "\"labels\"}, without the \"input.\" prefix; Golden.batch() gives a golden's "
                "batch so" % name)
    for name in batch:
        if not (isinstance(name, str) and (name.startswith("input.") or name in _BATCH_KEYS)):
            raise ConfigError(
                "batch has %r, which no model reads: its keys are %s"
                % (name, ", ".join('"%s"' % k for k in _BATCH_KEYS)))
    for name in masks or {}:
        if not (isinstance(name, str) and name.startswith("dropout.")):
            raise ConfigError(
                "masks has \"%s\": masks are named by their dropout site as in a golden "
                "(\"dropout.input\", \"dropout.layers.0.attn\", ...); Golden.masks() gives a "
                "golden's masks so" % (name,))


def run(cfg, params, batch, *, train=False, dropout_seed=0, masks=None, precision=None,
        fp8=None, backward=True, backend=None, threads=None, routing=None):
    """Forward (and backward, from the mean loss) on params and batch.

    Returns every act.* tensor of the golden contract, every grad.* tensor when backward is set,
    and the dropout.* masks when train mode applies dropout, as numpy arrays. cfg is a
    teo.ModelConfig or a dict of its keys. params ({"embedding.weight": ...}) are all float32
    or all float64 (the run's dtype); batch is {"tokens", "lengths", "labels"} (with
    type_vocab_size also "token_types"; with input "patches" {"pixels", "labels"} and optional
    "lengths"; an encoder_decoder's
    {"src_tokens", "src_lengths", "tgt_tokens", "tgt_lengths"}); masks
    ({"dropout.input": ...}) replay dropout masks in train mode instead of drawing them from
    dropout_seed. Arrays may be numpy arrays or torch tensors. A golden's Golden.params(),
    Golden.batch() and Golden.masks() give its own. precision emulates tf32, bf16 or fp16 in a
    float32 run, and "fp8" every linear product in fp8 under the recipe fp8, a dict of the fp8
    keys an op spec takes ({"fp8_format": "hybrid", "fp8_scaling": "block", ...}; docs/fp8.md;
    default E4M3 with one scale per tensor). backend ("reference", "simd", "blas"; default
    TEO_BACKEND's, else reference) and threads apply to this call only. routing ({1:
    ids, ...}) replays a mixture of experts' routing: for each MoE layer index given, its
    experts (B, S, k) integers, as a golden's act.layers.{i}.moe.topk_ids holds them, are used
    instead of the router's own choice (the router's logits and weights are still computed;
    a layer that is not an MoE layer, a wrong count or an id out of range is a ConfigError or
    ShapeError naming it, docs/golden-format.md, "Routing").
    """
    from . import ConfigError
    cfg = config_of(cfg)
    for what, d in (("params", params), ("batch", batch), ("masks", masks)):
        if d is not None and not isinstance(d, dict):
            raise ConfigError("%s must be a dict of name -> array, got %s"
                              % (what, type(d).__name__))
    _golden_names(params, batch, masks)
    params = {n: real_array(a, "params[%r]" % n, "teo.run") for n, a in params.items()}
    batch = {n: as_array(a) for n, a in batch.items() if n in _BATCH_KEYS}
    if masks is not None:
        masks = {n: as_array(a) for n, a in masks.items()}
    dtypes = {a.dtype for a in params.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (np.float32, np.float64):
        raise ConfigError("params must be all float32 or all float64 arrays, got %s"
                          % sorted(str(d) for d in dtypes))
    dtype = str(next(iter(dtypes)))
    if fp8 is not None and not isinstance(fp8, dict):
        raise ConfigError("fp8 must be a dict of fp8_* keys, got %s" % type(fp8).__name__)
    if routing is not None:
        if not isinstance(routing, dict):
            raise ConfigError("routing must be a dict of layer index -> expert ids, got %s"
                              % type(routing).__name__)
        given = {}
        for layer, ids in routing.items():
            ids = as_array(ids)
            if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool):
                raise ConfigError("routing's keys are layer indices, got %r" % (layer,))
            if not np.issubdtype(ids.dtype, np.integer):
                raise ConfigError("routing[%d] must hold integer expert ids, got %s"
                                  % (layer, ids.dtype))
            given[int(layer)] = ids
        routing = given
    wire = _teo.run(cfg, params, batch, bool(train), int(dropout_seed), precision, bool(backward),
                    backend_of(backend), threads, dtype, masks,
                    None if fp8 is None else json.dumps(fp8), routing)
    return arrays_of(wire)


def generate(cfg, params, prompt, steps, *, start_token=0, feed=None, backend=None, threads=None):
    """Greedy generation by a decoder with a KV cache (docs/semantics.md section 17.3).

    prompt is {"tokens" (B, S), "lengths" (B)}: sequence b's prompt is its first lengths[b]
    tokens (0 allowed). Returns {"tokens" (steps, B) int64, "logits" (steps, B, V)}: the token
    fed to each sequence at step t (the prompt's greedy next token at step 0, start_token after an
    empty prompt) and the logits after it, which are the full causal forward's at that position.
    feed (steps, B) integers: feed these tokens instead of the greedy ones (the tokens an engine
    under test chose), so that its logits can be compared step by step all the same. params as
    teo.run takes them; their dtype is the run's.
    """
    from . import ConfigError
    cfg = config_of(cfg)
    for what, d in (("params", params), ("prompt", prompt)):
        if not isinstance(d, dict):
            raise ConfigError("%s must be a dict of name -> array, got %s"
                              % (what, type(d).__name__))
    _golden_names(params, prompt, None)
    params = {n: real_array(a, "params[%r]" % n, "teo.generate") for n, a in params.items()}
    prompt = {n: as_array(a) for n, a in prompt.items()}
    dtypes = {a.dtype for a in params.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (np.float32, np.float64):
        raise ConfigError("params must be all float32 or all float64 arrays, got %s"
                          % sorted(str(d) for d in dtypes))
    if feed is not None:
        feed = as_array(feed)
    return _teo.generate(cfg, params, prompt, int(steps), int(start_token), feed,
                         backend_of(backend), threads, str(next(iter(dtypes))))
