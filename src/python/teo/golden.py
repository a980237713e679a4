"""Golden files and op cases: load, save, generate an op case, and check a candidate."""

import functools
import json
import os

from . import _teo
from ._wire import arrays_of, backend_of, bits_of, check_keywords, json_value, wire_of


class Golden:
    """A loaded golden file or op case.

    tensors: name -> ndarray (BF16 as ml_dtypes.bfloat16, or uint16 bit patterns where ml_dtypes
    is not installed; F16 as numpy.float16; F8_E4M3 and F8_E5M2 as uint8 bytes); metadata: the __metadata__ strings; config and case
    (model cases) or op and spec (op cases) parsed from it; path: where it was read from (None
    when made in memory). A model golden's params(), batch() and masks() are what teo.run takes.
    """

    def __init__(self, metadata, tensors, path=None, bits=None):
        self.metadata = dict(metadata)
        self.tensors = tensors
        self.path = path
        self._wire = None
        self._bits = dict(bits or {})  # name -> "BF16", "F8_E4M3", ...: tensors held as bits
        fmt = self.metadata.get("format")
        self.format = fmt
        self.config = self.case = self.op = self.spec = None
        if fmt == _teo.kFormat:
            self.config = _teo.ModelConfig.from_json(self.metadata.get("config", "{}"))
            self.case = json.loads(self.metadata.get("case", "null"))
        elif fmt == _teo.kOpFormat:
            self.op = self.metadata.get("op")
            self.spec = json.loads(self.metadata.get("spec", "null"))

    def wire(self):
        if self._wire is None:
            bits = {n: b for n, b in self._bits.items() if n in self.tensors and
                    self.tensors[n].dtype == ("uint8" if b.startswith("F8") else "uint16")}
            self._wire = wire_of(self.tensors, bits)
        return self._wire

    def inputs(self):
        """The tensors a backend reads: input.*, param.*, a quantized model's packed weights
        (quant.*), grad.output.* and dropout.* masks."""
        return {n: t for n, t in self.tensors.items()
                if n.startswith(("input.", "param.", "quant.", "grad.output.", "dropout."))}

    def _model_case(self, what):
        from . import ConfigError
        if self.format != _teo.kFormat:
            kind = ("an op case (op %s)" % self.op if self.op
                    else "not a golden (no \"format\": \"%s\" metadata)" % _teo.kFormat)
            raise ConfigError("Golden.%s() is for a model golden; %s is %s: use .tensors or "
                              ".inputs()" % (what, self.path or "this file", kind))

    def params(self):
        """The parameters as teo.run takes them: {"embedding.weight": ..., ...} (the param.*
        tensors without the prefix). A model golden's only: ConfigError otherwise."""
        self._model_case("params")
        return {n[len("param."):]: t for n, t in self.tensors.items() if n.startswith("param.")}

    def batch(self):
        """The batch as teo.run takes it: {"tokens", "lengths", "labels"} (input.*), and
        "token_types" with type_vocab_size; with input "patches" {"pixels", "lengths",
        "labels"}; a decoder's
        has no labels (its targets are its next tokens); an encoder_decoder's is {"src_tokens",
        "src_lengths", "tgt_tokens", "tgt_lengths"}."""
        self._model_case("batch")
        return {k[len("input."):]: v for k, v in self.tensors.items()
                if k.startswith("input.") and not k.startswith("input.generate.")}

    def masks(self):
        """The dropout masks as teo.run(masks=) takes them (with train=True):
        {"dropout.input": ..., "dropout.layers.0.attn": ...}; {} without dropout."""
        self._model_case("masks")
        return {n: t for n, t in self.tensors.items() if n.startswith("dropout.")}

    def __repr__(self):
        what = ("op %s" % self.op) if self.op else "model case"
        return "<teo.golden.Golden %s, %d tensors%s>" % (
            what, len(self.tensors), ", " + self.path if self.path else "")


def load(path):
    """Reads a golden file or op case (any safetensors file teo reads). A golden or op case is
    validated against its contract first: a malformed one raises FormatError naming the tensor."""
    return _load(path, validate=True)


def _load(path, validate):
    metadata, wire = _teo.read(os.fspath(path), validate)
    return Golden(metadata, arrays_of(wire), os.fspath(path), bits_of(wire))


def save(path, tensors, metadata=None, *, force=False, bits=None):
    """Writes name -> array as safetensors, atomically (a temporary file renamed into place),
    creating the folders it goes in. An existing file is a FileError unless force. Arrays are
    numpy arrays (ml_dtypes.bfloat16 included) or torch tensors of any dtype teo reads
    (bfloat16 as BF16, float16 as F16; requires_grad is fine). bits: see teo.golden.check.
    tensors may be a loaded Golden: its tensors in their own dtypes, with its metadata unless
    metadata is given."""
    from . import FileError
    path = os.fspath(path)
    if isinstance(tensors, Golden):
        metadata = tensors.metadata if metadata is None else metadata
        wire = tensors.wire()
    else:
        wire = wire_of(tensors, bits)
    meta = [(str(k), str(v)) for k, v in (metadata or {}).items()]
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise FileError("cannot create the folder %s for %s: %s"
                        % (folder, path, e.strerror or e)) from None
    _teo.write(path, meta, wire, bool(force))


@functools.lru_cache(maxsize=None)
def _spec_keys(op):
    """The keys op_case takes for op (the registry's, less "op"): computed once per op, from the
    op's normalised sample specs."""
    return tuple(k for k in _teo.op_keys(op) if k != "op")


def op_case(op, *, backend=None, threads=None, **spec):
    """Generates an op case in memory, as `teo golden op` writes it (spec: the keys of
    docs/golden-format.md, with dtype and seed; numpy and torch values are fine). It runs on
    backend ("reference", "simd", "blas"): by default the TEO_BACKEND environment variable's,
    as for `teo golden op`, else the process's (reference); threads sets the thread count for
    the call. An unknown op is a ConfigError listing the ops; a key the op does not take a
    TypeError naming the closest one."""
    check_keywords("teo.golden.op_case", spec, _spec_keys(op))
    metadata, wire = _teo.make_op(op, json_value(spec), backend_of(backend),
                                  None if threads is None else int(threads))
    return Golden(metadata, arrays_of(wire), bits=bits_of(wire))


class TensorReport:
    """One tensor's verdict: status is "pass", "fail", "not_checked", "vacuous" or "ambiguous"
    (a routed case's tensor that the routing of an ambiguous token decides); ratio is the error
    as a fraction of its bound (below 1 passes); excluded says which rows of ambiguous tokens
    were left out."""

    def __init__(self, d):
        self.name = d["name"]
        self.status = d["status"]
        self.max_abs = d.get("max_abs")
        self.max_rel = d.get("max_rel")
        self.bound = d.get("bound")
        self.ratio = d.get("ratio")
        # fp8: the distance from the emulated run in its errors (docs/fp8.md, "Judging")
        self.recipe_distance = d.get("recipe_distance")
        self.message = d.get("message", "")
        self.mismatch = d.get("mismatch")  # what differs when no values were compared
        self.suggestion = d.get("suggestion")  # a name not in the golden: the closest golden name
        self.excluded = d.get("excluded", "")

    def __repr__(self):
        return "<%s %s ratio=%s>" % (self.name, self.status, self.ratio)


class Report:
    """The verdict of one check. passed is the CLI's exit code 0; str() is the CLI's text."""

    def __init__(self, text, json_text, exit_code, reason):
        self.text = text
        self._json = json_text
        self.exit_code = exit_code
        self.reason = reason
        case = json.loads(json_text)["cases"][0]
        self.first_divergence = case["first_divergence"]
        self.precision = case["precision"]
        # why the precision is not the golden's own, that the golden is ill-conditioned
        self.notes = case.get("notes", [])
        self.tensors = [TensorReport(t) for t in case["tensors"]]
        self.optional_missing = case.get("optional_missing", [])
        # candidate names the golden does not hold: failures, or accepted with allow_extra
        self.unknown = [t.name for t in self.tensors if t.mismatch == "not in the golden"]
        self.extra = case.get("extra", [])
        self.counts = {k: case[k]
                       for k in ("passed", "failed", "not_checked", "vacuous", "ambiguous")}
        # routed cases: the tokens routed otherwise within the tolerance (dicts with layer,
        # token, margin, tolerance, golden and candidate)
        self.ambiguous_tokens = case.get("ambiguous_tokens", [])

    @property
    def passed(self):
        return self.exit_code == 0

    def to_json(self):
        return self._json

    def __str__(self):
        return self.text + (self.reason + "\n" if self.reason else "")

    def __bool__(self):
        return self.passed

    def __repr__(self):
        c = self.counts
        vacuous = ", %d vacuous" % c["vacuous"] if c.get("vacuous") else ""
        if c.get("ambiguous"):
            vacuous += ", %d ambiguous" % c["ambiguous"]
        return ("<teo.golden.Report %s %d passed, %d failed, %d not checked%s, "
                "first divergence: %s>" % ("PASS" if self.passed else "FAIL", c["passed"],
                                           c["failed"], c["not_checked"], vacuous,
                                           self.first_divergence))


def check(golden, candidate, *, precision=None, only=None, require_all=False, allow_extra=False,
          hide_unchecked=False, bits=None, rtol=None, atol=None, k=None, floor_eps=None,
          budget_k=None, budget_floor=None, fp8_recipe_k=None):
    """Judges candidate against golden by `teo golden check`'s rules and returns a Report.

    golden: a path or a loaded Golden. candidate: a path, a Golden, or a dict name -> array
    (numpy, ml_dtypes.bfloat16, float16, or torch tensors; uint16 bit patterns with
    bits={name: "BF16" or "F16"}, fp8 bytes with bits={name: "F8_E4M3" or "F8_E5M2"}). precision: what the candidate computed in (fp64, fp32,
    tf32, bf16, fp16, fp8; default implied by its dtypes). only: "forward" or "backward".
    budget_k, budget_floor and fp8_recipe_k are `teo golden check`'s --budget-k, --budget-floor
    and --fp8-recipe-k (float("inf") turns the fp8 recipe rule off).
    A candidate tensor the golden does not name fails (a misspelling), unless allow_extra;
    hide_unchecked leaves the rows of tensors not in the candidate out of str(report).
    """
    g = golden if isinstance(golden, Golden) else load(golden)
    if isinstance(candidate, (str, os.PathLike)):
        # a candidate is any file holding some of the golden's names: not validated as a golden
        c_wire = _load(candidate, validate=False).wire()
        c_name = os.fspath(candidate)
    elif isinstance(candidate, Golden):
        c_wire = candidate.wire()
        c_name = candidate.path or "<candidate>"
    else:
        c_wire = wire_of(candidate, bits)
        c_name = "<candidate>"
    tol = {name: value for name, value in
           (("rtol", rtol), ("atol", atol), ("k", k), ("floor_eps", floor_eps),
            ("budget_k", budget_k), ("budget_floor", budget_floor),
            ("fp8_recipe_k", fp8_recipe_k)) if value is not None}
    g_path = g.path or ("<%s op case>" % g.op if g.op else "<golden>")
    text, json_text, code, reason = _teo.check(
        list(g.metadata.items()), g.wire(), c_wire, os.path.basename(g_path), g_path, c_name,
        precision, only or "all", bool(require_all), bool(allow_extra), bool(hide_unchecked), tol)
    return Report(text, json_text, code, reason)
