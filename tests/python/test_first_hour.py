"""What a newcomer meets first: torch tensors of any float dtype wherever arrays are taken, a
golden's own parameters, batch and masks for teo.run, op cases on the chosen backend, keyword
typos named with the closest keyword, configs as dicts, a report's one-line repr, and BF16 without
ml_dtypes.

Run: PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python (ctest does).
"""

import json
import os
import struct
import subprocess
import warnings

import numpy as np
import pytest

import teo
from teo import _teo, _wire
from conftest import GOLDEN, TEO_BIN


def case(name):
    return teo.golden.load(os.path.join(GOLDEN, name + ".safetensors"))


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def header(path):
    """The safetensors header of the file at path: name -> {"dtype", "shape", ...}."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


@pytest.fixture
def no_ml_dtypes(monkeypatch):
    """teo as it is where ml_dtypes is not installed, with its warning not yet given."""
    monkeypatch.setattr(_wire, "BFLOAT16", None)
    monkeypatch.setattr(_wire, "_bf16_warned", False)


# ---- torch tensors wherever arrays are taken ----------------------------------------------------

@pytest.mark.parametrize("ml_dtypes", [True, False])
def test_save_creates_folders_and_takes_torch_tensors_of_every_float_dtype(
        tmp_path, monkeypatch, ml_dtypes):
    torch = pytest.importorskip("torch")
    if not ml_dtypes:
        monkeypatch.setattr(_wire, "BFLOAT16", None)
        monkeypatch.setattr(_wire, "_bf16_warned", True)  # (its own test below)
    elif _wire.BFLOAT16 is None:
        pytest.skip("ml_dtypes is not installed")
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    tensors = {"bf16": x.bfloat16(), "f16": x.half(), "f32": x.float(), "f64": x * 1,
               "grad_leaf": x, "strided": x.t(), "ids": torch.arange(4), "mask": x > 0}
    path = tmp_path / "new" / "folders" / "c.safetensors"
    teo.golden.save(path, tensors)
    dtypes = {n: e["dtype"] for n, e in header(path).items() if n != "__metadata__"}
    assert dtypes == {"bf16": "BF16", "f16": "F16", "f32": "F32", "f64": "F64", "grad_leaf": "F64",
                      "strided": "F64", "ids": "I64", "mask": "U8"}
    back = teo.golden.load(path).tensors
    bf16_bits = tensors["bf16"].detach().view(torch.int16).numpy().view(np.uint16)
    assert back["bf16"].view(np.uint16).tobytes() == bf16_bits.tobytes()
    assert back["f16"].tobytes() == tensors["f16"].detach().numpy().tobytes()
    assert same_bits(back["strided"], x.detach().numpy().T.copy())
    assert same_bits(back["mask"], (x > 0).numpy().astype(np.uint8))


def test_check_takes_a_torch_bfloat16_candidate_with_and_without_ml_dtypes(
        tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    g = teo.golden.load(os.path.join(GOLDEN, "ops", "attention_bf16.safetensors"))
    cand = {n: torch.from_numpy(a.astype(np.float32)).bfloat16() for n, a in g.tensors.items()
            if n.startswith(("output.", "grad.input."))}
    for have in (True, False):
        if not have:
            monkeypatch.setattr(_wire, "BFLOAT16", None)
            monkeypatch.setattr(_wire, "_bf16_warned", True)
        elif _wire.BFLOAT16 is None:
            continue
        r = teo.golden.check(g, cand)
        assert r.passed and r.precision == "bf16", str(r)
        # written and read back (as uint16 patterns without ml_dtypes), it still checks as BF16
        path = tmp_path / ("with" if have else "without") / "attention_bf16.safetensors"
        teo.golden.save(path, cand)
        assert teo.golden.check(g, str(path)).passed
        assert teo.golden.check(g, teo.golden.load(path)).passed


def test_run_and_ops_take_torch_tensors_with_the_bits_of_numpy():
    torch = pytest.importorskip("torch")
    g = case("dropout_post_f64")
    as_torch = {n: torch.tensor(a, requires_grad=True) for n, a in g.params().items()}
    batch = {n: torch.from_numpy(a) for n, a in g.batch().items()}
    masks = {n: torch.from_numpy(a).bool() for n, a in g.masks().items()}
    out = teo.run(g.config, as_torch, batch, train=True, masks=masks)
    ref = teo.run(g.config, g.params(), g.batch(), train=True, masks=g.masks())
    assert set(out) == set(ref) and all(same_bits(out[n], ref[n]) for n in out)

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 4)), rng.standard_normal((3, 4))
    t = torch.tensor(x.T.copy(), requires_grad=True).t()  # strided, requiring grad
    for a, b in ((teo.ops.linear(t, torch.from_numpy(w)), teo.ops.linear(x, w)),
                 (teo.ops.softmax(t, visible=torch.tensor([1, 2, 3, 4, 0])),
                  teo.ops.softmax(x, visible=[1, 2, 3, 4, 0])),
                 (teo.ops.pooling(t.reshape(1, 5, 4), torch.tensor([3])),
                  teo.ops.pooling(x.reshape(1, 5, 4), [3]))):
        assert set(a) == set(b) and all(same_bits(a[n], b[n]) for n in a)
    with pytest.raises(teo.ConfigError, match="x is bfloat16.*precision=\"bf16\""):
        teo.ops.linear(t.bfloat16(), torch.from_numpy(w).bfloat16())
    with pytest.raises(teo.ConfigError, match="float16"):
        teo.run(g.config, {n: a.half() for n, a in as_torch.items()}, batch)


# ---- a golden's own parameters, batch and masks -------------------------------------------------

def test_run_straight_from_a_model_golden():
    g = case("dropout_post_f64")
    params, batch, masks = g.params(), g.batch(), g.masks()
    assert set(params) == set(teo.init_params(g.config, 0))
    assert set(batch) == {"tokens", "lengths", "labels"}
    assert sorted(masks) == sorted(n for n in g.tensors if n.startswith("dropout."))
    # another seed would draw other masks: the golden's replayed give its bytes
    out = teo.run(g.config, params, batch, train=True, masks=masks,
                  dropout_seed=g.case["seed"] + 1, backend="reference")
    assert all(same_bits(out[n], g.tensors[n]) for n in out)
    assert len(out) == sum(n.startswith(("act.", "grad.", "dropout.")) for n in g.tensors)
    plain = case("post_gelu_mean_f64")
    assert plain.masks() == {}
    for train in (False, True):
        out = teo.run(plain.config, plain.params(), plain.batch(), train=train,
                      masks=plain.masks())
        assert same_bits(out["act.loss"], plain.tensors["act.loss"])


def test_params_batch_and_masks_are_for_model_goldens_only(tmp_path):
    op = teo.golden.load(os.path.join(GOLDEN, "ops", "linear_f64.safetensors"))
    for method in (op.params, op.batch, op.masks):
        with pytest.raises(teo.ConfigError, match="is for a model golden.*op case"):
            method()
    teo.golden.save(tmp_path / "c.safetensors", {"act.loss": np.zeros(())})
    with pytest.raises(teo.ConfigError, match="not a golden"):
        teo.golden.load(tmp_path / "c.safetensors").params()


def test_a_goldens_prefixed_names_say_what_teo_run_takes():
    g = case("post_gelu_mean_f64")
    with pytest.raises(teo.ConfigError, match=r'"param.embedding.weight".*without the "param\." '
                                              r'prefix.*Golden\.params\(\)'):
        teo.run(g.config, {n: a for n, a in g.tensors.items() if n.startswith("param.")},
                g.batch())
    with pytest.raises(teo.ConfigError, match=r'"input.tokens".*Golden\.batch\(\)'):
        teo.run(g.config, g.params(), g.inputs())
    with pytest.raises(teo.ConfigError, match=r'"layers.0.attn".*Golden\.masks\(\)'):
        teo.run(g.config, g.params(), g.batch(), train=True,
                masks={"layers.0.attn": np.ones((3, 3, 9, 9))})


# ---- op cases: backend, spec values -------------------------------------------------------------

LINEAR = {"dtype": "float64", "seed": 1, "rows": 7, "in_features": 33, "out_features": 5}


def test_op_case_runs_on_the_backend_given_or_TEO_BACKEND(monkeypatch, tmp_path):
    monkeypatch.delenv("TEO_BACKEND", raising=False)
    ref = teo.golden.op_case("linear", **LINEAR)
    simd = teo.golden.op_case("linear", backend="simd", threads=2, **LINEAR)
    assert same_bits(ref.tensors["output.y"],
                     teo.golden.op_case("linear", backend="reference", **LINEAR)
                     .tensors["output.y"])
    # simd sums in another order: other last bits (the same on every ISA and thread count)
    assert not same_bits(ref.tensors["output.y"], simd.tensors["output.y"])
    monkeypatch.setenv("TEO_BACKEND", "simd")
    from_env = teo.golden.op_case("linear", **LINEAR)
    assert all(same_bits(from_env.tensors[n], simd.tensors[n]) for n in simd.tensors)
    # as the CLI does under the same environment
    (tmp_path / "s.json").write_text(json.dumps(LINEAR))
    subprocess.run([TEO_BIN, "golden", "op", "--op", "linear", "--spec", str(tmp_path / "s.json"),
                    "--out", str(tmp_path / "l.safetensors")], check=True, capture_output=True)
    cli = teo.golden.load(tmp_path / "l.safetensors")
    assert all(same_bits(from_env.tensors[n], cli.tensors[n]) for n in cli.tensors)
    # backend= wins over the variable; a bad value names where it came from
    given = teo.golden.op_case("linear", backend="reference", **LINEAR)
    assert same_bits(given.tensors["output.y"], ref.tensors["output.y"])
    monkeypatch.setenv("TEO_BACKEND", "gpu")
    with pytest.raises(teo.ConfigError, match="TEO_BACKEND must be reference, simd or blas"):
        teo.golden.op_case("linear", **LINEAR)
    with pytest.raises(teo.ConfigError, match="^backend must be"):
        teo.golden.op_case("linear", backend="gpu", **LINEAR)


def test_op_case_spec_values_may_be_numpy_or_torch():
    plain = teo.golden.op_case("attention", dtype="float64", seed=2, batch=2, num_heads=2,
                               seq_len=4, d_head=3, lengths=[4, 1], scale=0.5)
    given = [dict(seed=np.uint64(2), batch=np.int64(2), lengths=np.array([4, 1]),
                  scale=np.float64(0.5))]
    try:
        import torch
        given.append(dict(seed=torch.tensor(2), batch=2, lengths=torch.tensor([4, 1]),
                          scale=torch.tensor(0.5, dtype=torch.float64)))
    except ImportError:
        pass
    for spec in given:
        g = teo.golden.op_case("attention", **dict(dict(dtype="float64", num_heads=2, seq_len=4,
                                                        d_head=3), **spec))
        assert g.metadata == plain.metadata
        assert all(same_bits(g.tensors[n], plain.tensors[n]) for n in plain.tensors)


# ---- keyword typos ------------------------------------------------------------------------------

X = np.zeros((2, 3))
QKV = np.zeros((1, 2, 3, 2))
LAYER = {"num_heads": 2, "d_ff": 8}


@pytest.mark.parametrize("call, message", [
    (lambda: teo.ops.attention(QKV, QKV, QKV, slidng_window=2),
     "teo.ops.attention() got an unexpected keyword argument 'slidng_window'; "
     "did you mean 'sliding_window'?"),
    (lambda: teo.ops.layer_norm(X, np.ones(3), np.zeros(3), eps=1e-6),
     "teo.ops.layer_norm() got an unexpected keyword argument 'eps'; "
     "did you mean 'layer_norm_eps'?"),
    (lambda: teo.ops.softmax(X, visibel=[1, 2]),
     "teo.ops.softmax() got an unexpected keyword argument 'visibel'; did you mean 'visible'?"),
    (lambda: teo.ops.linear(X, np.zeros((4, 3)), backnd="simd"),
     "teo.ops.linear() got an unexpected keyword argument 'backnd'; did you mean 'backend'?"),
    (lambda: teo.ops.activation(X, activaton="relu"),
     "teo.ops.activation() got an unexpected keyword argument 'activaton'; "
     "did you mean 'activation'?"),
    (lambda: teo.ops.dropout(X, X, dropout=0.1, grad=X),
     "teo.ops.dropout() got an unexpected keyword argument 'grad'; did you mean 'grad_y'?"),
    (lambda: teo.ops.embedding(np.zeros((1, 2), dtype=np.int64), X, positonal="learned"),
     "teo.ops.embedding() got an unexpected keyword argument 'positonal'; "
     "did you mean 'positional'?"),
    (lambda: teo.ops.pooling(np.zeros((1, 2, 3)), [2], pool="max"),
     "teo.ops.pooling() got an unexpected keyword argument 'pool'; did you mean 'pooling'?"),
    (lambda: teo.ops.cross_entropy(X, [0, 1], label_smothing=0.1),
     "teo.ops.cross_entropy() got an unexpected keyword argument 'label_smothing'; "
     "did you mean 'label_smoothing'?"),
    (lambda: teo.ops.encoder_layer(np.zeros((1, 2, 4)), [2], {}, num_head=2),
     "teo.ops.encoder_layer() got an unexpected keyword argument 'num_head'; "
     "did you mean 'num_heads'?"),
    (lambda: teo.ops.encoder_layer(np.zeros((1, 2, 4)), [2], {}, norm_frist=True, **LAYER),
     "teo.ops.encoder_layer() got an unexpected keyword argument 'norm_frist'; "
     "did you mean 'norm_first'?"),
    (lambda: teo.golden.op_case("attention", dtype="float64", seed=0, batch=1, num_heads=1,
                                seq_len=2, d_head=2, slidng_window=1),
     "teo.golden.op_case() got an unexpected keyword argument 'slidng_window'; "
     "did you mean 'sliding_window'?"),
    (lambda: teo.golden.op_case("linear", dtype="float64", seed=0, row=2, in_features=2,
                                out_features=2),
     "teo.golden.op_case() got an unexpected keyword argument 'row'; did you mean 'rows'?"),
    (lambda: teo.testing.assert_matches_golden(case("one_layer_f64"), {}, requre_all=True),
     "teo.testing.assert_matches_golden() got an unexpected keyword argument 'requre_all'; "
     "did you mean 'require_all'?"),
])
def test_a_misspelled_keyword_names_the_function_and_the_closest_keyword(call, message):
    with pytest.raises(TypeError) as e:
        call()
    assert str(e.value) == message


def test_an_unknown_op_lists_the_ops():
    with pytest.raises(teo.ConfigError, match="unknown op.*linear, layer_norm"):
        teo.golden.op_case("conv", dtype="float64", seed=0)


def test_the_keywords_are_the_op_registrys():
    # every spec key of the attention op is an argument of teo.ops.attention, or set by it
    by_function = {"op", "dtype", "seed", "precision", "batch", "num_heads", "seq_len", "d_head",
                   "lengths", "causal", "num_kv_heads", "attn_sinks", "scale", "probs",
                   "q_len", "kv_len", "q_lengths", "kv_lengths", "d_head_v", "causal_align", "lse",
                   "lse_grad"}
    # the fp8 recipe's keys (docs/fp8.md) belong to every op case, not to one function
    fp8 = {"fp8_format", "fp8_scaling", "fp8_block_k", "fp8_weight_block", "fp8_accumulate",
           "fp8_mantissa_bits", "fp8_promote_every", "fp8_saturate", "fp8_attention", "fp8_scales", "fp8_outlier"}
    assert fp8 <= set(_teo.op_keys("linear"))
    assert set(_teo.op_keys("attention")) - fp8 == by_function | set(teo.ops.ATTENTION_VARIANT_KEYS)
    assert {"num_heads", "d_ff", "norm_first", "sliding_window", "attn_sinks"} \
        <= set(teo.ops.ENCODER_LAYER_OPTIONS)
    assert "rows" in _teo.op_keys("linear") and "bias" in _teo.op_keys("linear")
    # the valid keywords still work
    out = teo.ops.layer_norm(X + np.arange(3), np.ones(3), np.zeros(3), layer_norm_eps=1e-3,
                             backend="simd", threads=1)
    assert out["output.y"].shape == (2, 3)


# ---- configs as dicts ---------------------------------------------------------------------------

def test_a_config_may_be_a_dict_everywhere():
    g = case("post_gelu_mean_f64")
    d = g.config.to_dict()
    params = teo.init_params(d, g.case["seed"])
    assert all(same_bits(params[n], g.tensors["param." + n]) for n in params)
    batch = teo.random_batch(d, g.case["batch"], g.case["seq_len"], g.case["seed"],
                             np.array(g.case["lengths"]))
    assert all(same_bits(batch[k], g.tensors["input." + k]) for k in batch)
    out = teo.run(d, params, batch, train=True)
    assert same_bits(out["act.loss"], g.tensors["act.loss"])
    assert teo.init_params(g.config.to_json(), 1).keys() == params.keys()
    with pytest.raises(teo.ConfigError, match="d_modle"):
        teo.run(dict(d, d_modle=8), params, batch)
    with pytest.raises(TypeError, match="teo.ModelConfig, a dict"):
        teo.init_params([("d_model", 8)], 1)


# ---- reports ------------------------------------------------------------------------------------

def test_a_reports_repr_is_its_verdict_in_one_line():
    g = case("post_relu_cls_f64")
    acts = {n: a for n, a in g.tensors.items() if n.startswith("act.layers.0.")}
    r = teo.golden.check(g, acts)
    n_checked = len([t for t in g.tensors if t.startswith(("act.", "grad."))])
    assert repr(r) == ("<teo.golden.Report PASS %d passed, 0 failed, %d not checked, "
                       "first divergence: None>" % (len(acts), n_checked - len(acts)))
    bad = dict(acts, **{"act.layers.0.q": acts["act.layers.0.q"] + 1})
    r = teo.golden.check(g, bad)
    assert repr(r).startswith("<teo.golden.Report FAIL %d passed, 1 failed" % (len(acts) - 1))
    assert repr(r).endswith("first divergence: layers.0.q>")


# ---- BF16 without ml_dtypes ---------------------------------------------------------------------

def test_bf16_without_ml_dtypes_loads_as_bits_with_one_warning(tmp_path, no_ml_dtypes):
    bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0 and -2.0
    teo.golden.save(tmp_path / "b.safetensors", {"x": bits, "y": bits}, bits={"x": "BF16",
                                                                            "y": "BF16"})
    with pytest.warns(UserWarning, match=r'BF16 tensors \(x\) load as uint16 bit patterns.*'
                                         r'pip install "ml_dtypes<0.5"') as caught:
        x = teo.golden.load(tmp_path / "b.safetensors").tensors["x"]
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller
    assert x.dtype == np.uint16 and x.tolist() == [0x3F80, 0xC000]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        g = teo.golden.load(tmp_path / "b.safetensors")
    # read back as bit patterns, it is written back as BF16
    teo.golden.save(tmp_path / "again.safetensors", g.tensors, bits={"x": "BF16", "y": "BF16"})
    assert header(tmp_path / "again.safetensors")["x"]["dtype"] == "BF16"


# ---- no silent passes ---------------------------------------------------------------------------

def test_a_misspelled_candidate_name_fails_with_the_closest_golden_name():
    g = case("causal_post_f64")
    c = {n: a for n, a in g.tensors.items() if n.startswith("act.layers.")}
    c["act.layer.0.output"] = c.pop("act.layers.0.output") * 2  # a typo, and a wrong value
    r = teo.golden.check(g, c)
    assert not r.passed and r.exit_code == 1
    assert r.unknown == ["act.layer.0.output"]
    bad = [t for t in r.tensors if t.name == "act.layer.0.output"][0]
    assert bad.status == "fail" and bad.ratio is None and bad.mismatch == "not in the golden"
    assert 'did you mean "act.layers.0.output"?' in bad.message
    assert 'did you mean "act.layers.0.output"?' in str(r)
    assert r.first_divergence is None
    ok = teo.golden.check(g, c, allow_extra=True)
    assert ok.passed and ok.extra == ["act.layer.0.output"] and ok.unknown == []
    assert "accepted by --allow-extra: act.layer.0.output" in str(ok)


def test_hide_unchecked_leaves_only_the_checked_rows():
    g = case("causal_post_f64")
    c = {n: g.tensors[n] for n in ("act.layers.0.output", "act.layers.1.output", "act.loss")}
    rows = [line for line in str(teo.golden.check(g, c, hide_unchecked=True)).splitlines()
            if line.startswith("  act.") or line.startswith("  grad.")]
    assert len(rows) == 3, rows
    assert "69 rows of tensors not checked hidden" in str(teo.golden.check(g, c,
                                                                           hide_unchecked=True))


def test_a_shape_or_dtype_mismatch_has_no_ratio_and_says_what_differs():
    g = case("causal_post_f64")
    probs = g.tensors["act.layers.0.probs"]
    r = teo.golden.check(g, {"act.layers.0.probs": probs[..., :-1],
                             "act.layers.0.output": g.tensors["act.layers.0.output"].astype(
                                 np.float32)})
    by = {t.name: t for t in r.tensors}
    assert by["act.layers.0.probs"].ratio is None
    assert by["act.layers.0.probs"].mismatch.startswith("shape mismatch: candidate [")
    assert by["act.layers.0.output"].ratio is None
    assert "--precision fp32" in by["act.layers.0.output"].message
    assert 'precision="fp32"' in by["act.layers.0.output"].message
