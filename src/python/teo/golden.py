"""Golden files and op cases: load, save, generate an op case, and check a candidate."""

import json
import os

from . import _teo
from ._wire import arrays_of, wire_of


class Golden:
    """A loaded golden file or op case.

    tensors: name -> ndarray (BF16 as ml_dtypes.bfloat16, F16 as numpy.float16);
    metadata: the __metadata__ strings; config and case (model cases) or op and spec (op
    cases) parsed from it; path: where it was read from (None when made in memory).
    """

    def __init__(self, metadata, tensors, path=None):
        self.metadata = dict(metadata)
        self.tensors = tensors
        self.path = path
        self._wire = None
        fmt = self.metadata.get("format")
        self.format = fmt
        self.config = self.case = self.op = self.spec = None
        if fmt == _teo.kFormat:
            self.config = _teo.EncoderConfig.from_json(self.metadata.get("config", "{}"))
            self.case = json.loads(self.metadata.get("case", "null"))
        elif fmt == _teo.kOpFormat:
            self.op = self.metadata.get("op")
            self.spec = json.loads(self.metadata.get("spec", "null"))

    def wire(self):
        if self._wire is None:
            self._wire = wire_of(self.tensors)
        return self._wire

    def inputs(self):
        """The tensors a backend reads: input.*, param.*, grad.output.* and dropout.* masks."""
        return {n: t for n, t in self.tensors.items()
                if n.startswith(("input.", "param.", "grad.output.", "dropout."))}

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
    return Golden(metadata, arrays_of(wire), os.fspath(path))


def save(path, tensors, metadata=None, *, force=False, bits=None):
    """Writes name -> array as safetensors, atomically (a temporary file renamed into place).
    An existing file is a FileError unless force. bits: see teo.golden.check."""
    meta = [(str(k), str(v)) for k, v in (metadata or {}).items()]
    _teo.write(os.fspath(path), meta, wire_of(tensors, bits), bool(force))


def op_case(op, **spec):
    """Generates an op case in memory, as `teo golden op` writes it (spec: the keys of
    docs/golden-format.md, with dtype and seed)."""
    metadata, wire = _teo.make_op(op, spec)
    return Golden(metadata, arrays_of(wire))


class TensorReport:
    """One tensor's verdict: status is "pass", "fail", "not_checked" or "vacuous"; ratio is the
    error as a fraction of its bound (below 1 passes)."""

    def __init__(self, d):
        self.name = d["name"]
        self.status = d["status"]
        self.max_abs = d.get("max_abs")
        self.max_rel = d.get("max_rel")
        self.bound = d.get("bound")
        self.ratio = d.get("ratio")
        self.message = d.get("message", "")

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
        self.tensors = [TensorReport(t) for t in case["tensors"]]
        self.optional_missing = case.get("optional_missing", [])
        self.counts = {k: case[k] for k in ("passed", "failed", "not_checked", "vacuous")}

    @property
    def passed(self):
        return self.exit_code == 0

    def to_json(self):
        return self._json

    def __str__(self):
        return self.text + (self.reason + "\n" if self.reason else "")

    def __bool__(self):
        return self.passed


def check(golden, candidate, *, precision=None, only=None, require_all=False, bits=None,
          rtol=None, atol=None, k=None, floor_eps=None, budget_k=None, budget_floor=None):
    """Judges candidate against golden by `teo golden check`'s rules and returns a Report.

    golden: a path or a loaded Golden. candidate: a path, a Golden, or a dict name -> array
    (numpy, ml_dtypes.bfloat16, float16, or torch tensors; uint16 bit patterns with
    bits={name: "BF16" or "F16"}). precision: what the candidate computed in (fp64, fp32,
    tf32, bf16, fp16; default implied by its dtypes). only: "forward" or "backward".
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
            ("budget_k", budget_k), ("budget_floor", budget_floor)) if value is not None}
    g_path = g.path or ("<%s op case>" % g.op if g.op else "<golden>")
    text, json_text, code, reason = _teo.check(
        list(g.metadata.items()), g.wire(), c_wire, os.path.basename(g_path), g_path, c_name,
        precision, only or "all", bool(require_all), tol)
    return Report(text, json_text, code, reason)
