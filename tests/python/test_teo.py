"""The Python module: every function, bit identity with the C++ library and CLI, the error
mapping, memory over 10,000 calls, concurrent calls from Python threads, and a 0-size batch.

Run: PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python (ctest does).
"""

import json
import os
import subprocess
import threading

import numpy as np
import pytest

import teo
from conftest import GOLDEN, TEO_BIN

OPS = os.path.join(GOLDEN, "ops")


def case(name):
    return teo.golden.load(os.path.join(GOLDEN, name + ".safetensors"))


def op_case(name):
    return teo.golden.load(os.path.join(OPS, name + ".safetensors"))


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ---- config, parameters, batches -----------------------------------------------------------------

def test_config_from_keys_json_and_dict():
    cfg = teo.ModelConfig(d_model=8, num_heads=2, activation="relu")
    assert cfg.d_model == 8 and cfg.activation == "relu" and cfg.num_layers == 2
    assert teo.ModelConfig.from_json(cfg.to_json()) == cfg
    assert teo.ModelConfig.from_json(cfg.to_dict()) == cfg
    assert teo.ModelConfig(**cfg.to_dict()) == cfg
    with pytest.raises(AttributeError):
        cfg.colour
    # the former name is the same class, and the sections' keys read flat
    assert teo.EncoderConfig is teo.ModelConfig
    assert isinstance(teo.EncoderConfig(d_model=8, num_heads=2), teo.ModelConfig)


@pytest.mark.parametrize("keys, field", [({"d_modle": 8}, "d_modle"),
                                         ({"num_heads": 0}, "num_heads"),
                                         ({"activation": "swish"}, "activation"),
                                         ({"dropout": 1.5}, "dropout")])
def test_config_errors_name_the_field(keys, field):
    with pytest.raises(teo.ConfigError, match=field) as e:
        teo.ModelConfig(**keys)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("name", ["post_gelu_mean_f64", "learned_pe_f32", "dropout_post_f64",
                                  "gpt2_dropout_smoothing_f64", "llama_block_f32",
                                  "seq2seq_bart_f32", "seq2seq_pre_own_vocab_f64", "bert_f32",
                                  "vit_f64"])
def test_init_params_and_random_batch_are_the_goldens_bits(name):
    g = case(name)
    dtype = g.case["dtype"]
    params = teo.init_params(g.config, g.case["seed"], dtype)
    assert set("param." + n for n in params) == {n for n in g.tensors if n.startswith("param.")}
    for n, a in params.items():
        assert same_bits(a, g.tensors["param." + n]), n
    batch = teo.random_batch(g.config, g.case["batch"], g.case["seq_len"], g.case["seed"],
                             g.case["lengths"], g.case.get("tgt_len", 0),
                             g.case.get("tgt_lengths"))
    assert set(batch) == {n[len("input."):] for n in g.tensors if n.startswith("input.")}
    for k in batch:
        assert same_bits(batch[k], g.tensors["input." + k]), k


# ---- run: bit identity with the corpus ------------------------------------------------------------

@pytest.mark.parametrize("name", ["post_gelu_mean_f64", "causal_pre_f32", "dropout_post_f64",
                                  "pre_gelu_tanh_max_f32", "lengths_zero_f64",
                                  "gpt2_dropout_smoothing_f64", "llama_block_f32",
                                  "decoder_no_targets_f64", "encoder_rms_geglu_nobias_f64",
                                  "seq2seq_post_f64", "seq2seq_bart_f32", "bert_dropout_f64",
                                  "bert_rms_pre_types3_f64", "vit_f64", "vit_f32"])
def test_run_reproduces_the_goldens_bytes_on_the_reference_backend(name):
    g = case(name)
    params = {n[len("param."):]: a for n, a in g.tensors.items() if n.startswith("param.")}
    batch = g.batch()  # a decoder's has no labels
    out = teo.run(g.config, params, batch, train=True, dropout_seed=g.case["seed"],
                  backend="reference")
    expected = {n for n in g.tensors if n.startswith(("act.", "grad.", "dropout."))}
    assert set(out) == expected
    for n in expected:
        assert same_bits(out[n], g.tensors[n]), n


def test_run_options_forward_only_eval_mode_simd_threads_and_precision():
    g = case("dropout_post_f64")
    params = {n[6:]: a for n, a in g.tensors.items() if n.startswith("param.")}
    batch = {k: g.tensors["input." + k] for k in ("tokens", "lengths", "labels")}
    out = teo.run(g.config, params, batch, backward=False)
    assert not any(n.startswith(("grad.", "dropout.")) for n in out)
    one = teo.run(g.config, params, batch, backend="simd", threads=1)
    two = teo.run(g.config, params, batch, backend="simd", threads=2)
    for n in one:
        assert same_bits(one[n], two[n]), n
    p32 = {n: a.astype(np.float32) for n, a in params.items()}
    bf = teo.run(g.config, p32, batch, precision="bf16")
    assert bf["act.loss"].dtype == np.float32
    assert abs(float(bf["act.loss"]) - float(out["act.loss"])) < 0.05


def test_run_fp8_takes_the_recipe():
    # fp8_pre_block's own recipe (4 x 4 blocks) gives the checker's emulated run: recipe distance 0
    # at every tensor; the default recipe (one scale per tensor) is another run
    g = case("fp8_pre_block")
    recipe = {k: v for k, v in g.case.items() if k.startswith("fp8_")}
    assert recipe["fp8_scaling"] == "block"
    p32, batch = g.params(), g.batch()
    kw = dict(train=True, dropout_seed=g.case["seed"], precision="fp8")
    own = teo.run(g.config, p32, batch, fp8=recipe, **kw)
    cand = {n: a for n, a in own.items() if n.startswith(("act.", "grad."))}
    r = teo.golden.check(g, cand, precision="fp8")
    assert r.passed and r.counts["passed"] == len(cand) - r.counts["vacuous"], str(r)
    assert max(t.recipe_distance for t in r.tensors) == 0
    default = teo.run(g.config, p32, batch, **kw)
    assert all(same_bits(default[n], a) for n, a in teo.run(g.config, p32, batch, fp8={},
                                                            **kw).items())
    r = teo.golden.check(g, {n: default[n] for n in cand}, precision="fp8")
    assert max(t.recipe_distance for t in r.tensors) > 0.5
    with pytest.raises(teo.ConfigError, match='applies with precision="fp8" only'):
        teo.run(g.config, p32, batch, precision="bf16", fp8=recipe)
    with pytest.raises(teo.ConfigError, match='unknown key "fp8_scalling"; did you mean'):
        teo.run(g.config, p32, batch, fp8={"fp8_scalling": "mx"}, **kw)
    with pytest.raises(teo.ConfigError, match="fp8.fp8_block_k must be an integer"):
        teo.run(g.config, p32, batch, fp8={"fp8_block_k": 0}, **kw)
    with pytest.raises(teo.ConfigError, match="delayed scales"):
        teo.run(g.config, p32, batch, fp8={"fp8_scales": "delayed"}, **kw)


def test_run_replays_given_masks():
    g = case("dropout_post_f64")
    params = {n[6:]: a for n, a in g.tensors.items() if n.startswith("param.")}
    batch = {k: g.tensors["input." + k] for k in ("tokens", "lengths", "labels")}
    masks = {n: a for n, a in g.tensors.items() if n.startswith("dropout.")}
    # A seed that draws other masks: the replayed ones decide, and give the golden's bytes.
    out = teo.run(g.config, params, batch, train=True, dropout_seed=g.case["seed"] + 1,
                  masks=masks, backend="reference")
    for n in g.tensors:
        if n.startswith(("act.", "grad.", "dropout.")):
            assert same_bits(out[n], g.tensors[n]), n
    other = teo.run(g.config, params, batch, train=True, dropout_seed=g.case["seed"] + 1)
    assert not same_bits(other["act.loss"], g.tensors["act.loss"])
    with pytest.raises(teo.ShapeError, match="dropout.input"):
        teo.run(g.config, params, batch, train=True, masks={"dropout.input": np.ones(3)})
    with pytest.raises(teo.ConfigError, match="not a dropout site"):
        teo.run(g.config, params, batch, train=True, masks={"dropout.layers.9.attn": np.ones(3)})
    with pytest.raises(teo.ConfigError, match="no dropout applies"):
        teo.run(g.config, params, batch, train=False, masks=masks)


def test_config_fields_include_the_defaults_of_the_block_keys():
    cfg = teo.ModelConfig()
    assert (cfg.norm, cfg.ffn, cfg.head_bias, cfg.architecture) == ("layernorm", "mlp", True,
                                                                   "encoder")
    assert "norm" not in cfg.to_dict()  # written only when set
    dec = teo.ModelConfig(architecture="decoder")
    assert dec.causal is True
    with pytest.raises(AttributeError):
        dec.num_classes  # a decoder has no classifier


def test_a_decoder_reads_no_labels_and_refuses_them():
    cfg = teo.ModelConfig(architecture="decoder", vocab_size=16, d_model=8, num_heads=2,
                            num_layers=1, tie_embeddings=True, head_bias=False)
    batch = teo.random_batch(cfg, 2, 5, 3)
    assert set(batch) == {"tokens", "lengths"}
    out = teo.run(cfg, teo.init_params(cfg, 1), batch)
    assert out["act.lm_logits"].shape == (2, 5, 16)
    assert "grad.lm_head.weight" not in out  # tied: its gradient is in the embedding's
    with pytest.raises(teo.ConfigError, match="a decoder reads none"):
        teo.run(cfg, teo.init_params(cfg, 1), dict(batch, labels=np.zeros(2, dtype=np.int64)))


def test_token_types_are_read_with_type_vocab_size_and_refused_without():
    cfg = dict(vocab_size=16, d_model=8, num_heads=2, num_layers=1, type_vocab_size=2,
               embedding_norm=True, pooler="dense_tanh", pooling="cls")
    batch = teo.random_batch(cfg, 2, 5, 3)
    assert batch["token_types"].shape == (2, 5)
    assert set(np.unique(batch["token_types"])) <= {0, 1}
    params = teo.init_params(cfg, 1)
    out = teo.run(cfg, params, batch)
    assert out["act.pooler"].shape == (2, 8) and np.all(np.abs(out["act.pooler"]) < 1)
    # the token types reach the output: other types, other pooled vectors
    other = teo.run(cfg, params, dict(batch, token_types=1 - batch["token_types"]))
    assert not np.array_equal(out["act.pooled"], other["act.pooled"])
    with pytest.raises(teo.ConfigError, match="no \"token_types\""):
        teo.run(cfg, params, {k: v for k, v in batch.items() if k != "token_types"})
    plain = dict(vocab_size=16, d_model=8, num_heads=2, num_layers=1)
    with pytest.raises(teo.ConfigError, match="no type_vocab_size"):
        teo.run(plain, teo.init_params(plain, 1), batch)
    # a misspelled key is named, not dropped
    with pytest.raises(teo.ConfigError, match="token_type\'"):
        teo.run(cfg, params, dict(batch, token_type=batch["token_types"]))
    # the embedding op's norm arguments are refused without the norm, not dropped
    w = np.ones((16, 8))
    with pytest.raises(teo.ConfigError, match="need norm_weight"):
        teo.ops.embedding(batch["tokens"], w, norm_bias=np.zeros(8))
    with pytest.raises(teo.ConfigError, match="an rmsnorm none"):
        teo.ops.embedding(batch["tokens"], w, norm_weight=np.ones(8), norm_bias=np.zeros(8),
                          norm="rmsnorm")


def _patch_columns(pixels, patch_size):
    """im2col of ViT's patch embedding, in numpy: (B, Ch, Img, Img) -> (B, Np, Ch P P), patch
    n = py G + px flattened in (Ch, P, P) order, as Conv2d's weight is."""
    B, Ch, img, _ = pixels.shape
    G, P = img // patch_size, patch_size
    return pixels.reshape(B, Ch, G, P, G, P).transpose(0, 2, 4, 1, 3, 5).reshape(B, G * G, -1)


def test_vit_reads_pixels_and_reproduces_its_golden():
    g = case("vit_f64")
    assert "input.tokens" not in g.tensors and "vocab_size" not in g.config.to_dict()
    params, batch = g.params(), g.batch()
    assert set(batch) == {"pixels", "lengths", "labels"}
    out = teo.run(g.config, params, batch, backend="reference")
    for n in ("act.logits", "grad.patch_embedding.weight", "grad.cls_token"):
        assert same_bits(out[n], g.tensors[n]), n
    assert not any("pixels" in n for n in out)  # the pixels get no gradient
    # act.embedding: [CLS], then each patch's linear map (the stride-P convolution)
    emb, D = out["act.embedding"], g.config.d_model
    assert emb.shape == (2, 1 + (6 // 2) ** 2, D)
    assert same_bits(emb[:, 0], np.broadcast_to(params["cls_token"], (2, D)))
    cols = _patch_columns(batch["pixels"], g.config.patch_size)
    w = params["patch_embedding.weight"].reshape(D, -1)
    np.testing.assert_allclose(emb[:, 1:], cols @ w.T + params["patch_embedding.bias"],
                               rtol=0, atol=1e-14)
    # [CLS]'s gradient is the batch's sum of row 0 of the embedding's (here act.input's)
    assert same_bits(out["grad.cls_token"], out["grad.act.input"][:, 0].sum(0))
    # lengths may be left out: an image is never padded
    no_lengths = teo.run(g.config, params, {k: v for k, v in batch.items() if k != "lengths"},
                         backend="reference")
    assert same_bits(no_lengths["act.logits"], g.tensors["act.logits"])


def test_random_batch_for_patches_draws_the_goldens_pixels():
    g = case("vit_f64")
    assert (g.case["seed"], g.case["batch"]) == (3108, 2)
    batch = teo.random_batch(g.config, g.case["batch"], g.case["seq_len"], g.case["seed"])
    assert set(batch) == {"pixels", "lengths", "labels"}
    assert same_bits(batch["pixels"], g.tensors["input.pixels"])
    assert batch["lengths"].tolist() == [1 + (6 // 2) ** 2] * 2
    # a float32 golden holds the same draws, rounded (exactly) to float32
    g32 = case("vit_f32")
    b32 = teo.random_batch(g32.config, g32.case["batch"], g32.case["seq_len"], g32.case["seed"])
    assert same_bits(b32["pixels"].astype(np.float32), g32.tensors["input.pixels"])
    # every pixel is a multiple of 2^-8 in [-1, 1): exact in bf16 and fp16 too
    cfg = dict(input="patches", image_size=16, patch_size=4, channels=3, d_model=8, num_heads=2,
               num_layers=1)
    px = teo.random_batch(cfg, 4, 17, 5)["pixels"]
    assert px.shape == (4, 3, 16, 16) and px.dtype == np.float64
    assert np.all((px >= -1) & (px < 1))
    assert np.array_equal(px * 256, np.round(px * 256))
    assert len(np.unique(px)) > 256  # not a degenerate draw
    assert not np.array_equal(px, teo.random_batch(cfg, 4, 17, 6)["pixels"])


def test_patches_errors_are_named():
    g = case("vit_f64")
    cfg, params, batch = g.config.to_dict(), g.params(), g.batch()
    with pytest.raises(teo.ConfigError, match='the batch has "tokens"'):
        teo.run(cfg, params, dict(batch, tokens=np.zeros((2, 10), dtype=np.int64)))
    plain = dict(vocab_size=16, d_model=8, num_heads=2, num_layers=1)
    with pytest.raises(teo.ConfigError, match='the batch has "pixels"'):
        teo.run(plain, teo.init_params(plain, 1),
                dict(teo.random_batch(plain, 2, 5, 3), pixels=batch["pixels"]))
    with pytest.raises(teo.ShapeError, match=r"\(2, 3, 4, 4\), expected \(batch, 3, 6, 6\)"):
        teo.run(cfg, params, dict(batch, pixels=batch["pixels"][:, :, :4, :4]))
    with pytest.raises(teo.ShapeError, match="pixels"):
        teo.run(cfg, params, {k: v for k, v in batch.items() if k != "pixels"})
    with pytest.raises(teo.ConfigError, match='vocab_size applies only to input "tokens"'):
        teo.run(dict(cfg, vocab_size=16), params, batch)
    with pytest.raises(teo.ConfigError, match="max_len must be 10"):
        teo.ModelConfig(**dict(cfg, max_len=16))
    with pytest.raises(teo.InputError, match=r"lengths\[1\] = 7"):
        teo.run(cfg, params, dict(batch, lengths=np.array([10, 7])))
    with pytest.raises(teo.InputError, match=r"lengths\[1\] = 5"):
        teo.random_batch(cfg, 2, 10, 1, [10, 5])
    with pytest.raises(teo.ShapeError, match=r"seq_len 9 is not 1 \+ patches = 10"):
        teo.random_batch(cfg, 2, 9, 1)
    nan = batch["pixels"].copy()
    nan[1, 2, 3, 4] = np.nan
    with pytest.raises(teo.InputError, match="not finite"):
        teo.run(cfg, params, dict(batch, pixels=nan))
    with pytest.raises(teo.ConfigError, match="multiple of patch_size"):
        teo.ModelConfig(**dict(cfg, image_size=7))
    with pytest.raises(teo.ConfigError, match="cls_token"):
        teo.run(cfg, {n: a for n, a in params.items() if n != "cls_token"}, batch)


def test_generate_steps_are_the_full_forwards_logits():
    cfg = teo.ModelConfig(architecture="decoder", vocab_size=16, d_model=8, num_heads=2,
                            num_layers=2, norm_first=True, positional="rope", norm="rmsnorm",
                            ffn="swiglu", activation="silu", head_bias=False)
    params = teo.init_params(cfg, 3)
    prompt = teo.random_batch(cfg, 2, 4, 5, [4, 0])
    g = teo.generate(cfg, params, prompt, 3, start_token=1)
    assert g["tokens"].shape == (3, 2) and g["logits"].shape == (3, 2, 16)
    assert g["tokens"][0, 1] == 1  # the empty prompt starts from start_token
    for b, p in enumerate([4, 0]):
        seq = list(prompt["tokens"][b, :p]) + list(g["tokens"][:, b])
        full = {"tokens": np.array([seq + [0] * (7 - len(seq))], dtype=np.int64),
                "lengths": np.array([len(seq)], dtype=np.int64)}
        out = teo.run(cfg, params, full, backward=False)
        np.testing.assert_allclose(g["logits"][:, b], out["act.lm_logits"][0, p:p + 3],
                                   rtol=0, atol=1e-12)
    forced = teo.generate(cfg, params, prompt, 3, feed=np.array([[1, 2], [3, 4], [5, 6]]))
    assert forced["tokens"].tolist() == [[1, 2], [3, 4], [5, 6]]
    same = teo.generate(cfg, params, prompt, 3, start_token=1, feed=g["tokens"])
    assert np.array_equal(same["logits"], g["logits"])
    with pytest.raises(teo.ShapeError, match="feed"):
        teo.generate(cfg, params, prompt, 3, feed=np.array([[1, 2]]))
    with pytest.raises(teo.ConfigError, match="decoder"):
        enc = teo.ModelConfig(d_model=8, num_heads=2, num_layers=1)
        teo.generate(enc, teo.init_params(enc, 1), teo.random_batch(enc, 1, 2, 1), 1)


def test_a_mixture_of_experts_decoder_runs_and_generates():
    cfg = teo.ModelConfig(architecture="decoder", vocab_size=16, d_model=8, num_heads=2,
                            num_layers=2, norm_first=True, positional="rope", norm="rmsnorm",
                            ffn="moe", num_experts=4, num_experts_per_tok=2, moe_d_ff=6,
                            shared_d_ff=4, first_dense_layers=1, router_aux_loss_coef=0.5)
    assert cfg.num_experts == 4 and cfg.ffn == "moe"
    params = teo.init_params(cfg, 3)
    assert params["layers.1.moe.experts.w_down"].shape == (4, 8, 6)
    assert "layers.0.ffn.gate.weight" in params and "layers.1.ffn.fc1.weight" not in params
    batch = teo.random_batch(cfg, 2, 4, 5, [4, 2])
    out = teo.run(cfg, params, batch)
    assert out["act.layers.1.moe.expert_in"].shape == (2 * 4 * 2, 8)
    assert float(out["act.moe_aux_loss"]) > 0
    assert out["grad.layers.1.moe.gate.weight"].shape == (4, 8)
    g = teo.generate(cfg, params, batch, 2)
    assert g["logits"].shape == (2, 2, 16)
    with pytest.raises(teo.ConfigError, match="num_experts"):
        teo.ModelConfig(num_experts=4)


def test_router_replay_gives_own_routing_bit_for_bit_and_a_changed_one_routes_there():
    g = case("moe_mixtral_f64")
    cfg, params, batch = g.config, g.params(), g.batch()
    own = teo.run(cfg, params, batch)
    ids = {i: own["act.layers.%d.moe.topk_ids" % i] for i in range(cfg.num_layers)}
    replayed = teo.run(cfg, params, batch, routing=ids)
    for name, v in own.items():
        assert np.array_equal(v, replayed[name]), name
    # position (0, 0) of layer 1 sent to another expert: the replayed routing is what is used
    other = {i: v.copy() for i, v in ids.items()}
    chosen = set(other[1][0, 0])
    other[1][0, 0, 1] = next(e for e in range(cfg.num_experts) if e not in chosen)
    moved = teo.run(cfg, params, batch, routing=other)
    assert np.array_equal(moved["act.layers.1.moe.topk_ids"], other[1])
    assert not np.array_equal(moved["act.layers.1.ffn_out"], own["act.layers.1.ffn_out"])
    assert np.array_equal(moved["act.layers.1.moe.logits"], own["act.layers.1.moe.logits"])
    with pytest.raises(teo.ConfigError, match="integer"):
        teo.run(cfg, params, batch, routing={1: ids[1].astype(np.float64)})
    with pytest.raises(teo.ConfigError, match="not in"):
        teo.run(cfg, params, batch, routing={1: ids[1] + cfg.num_experts})
    with pytest.raises(teo.ShapeError):
        teo.run(cfg, params, batch, routing={1: ids[1][:1]})


def test_a_zero_size_batch():
    cfg = teo.ModelConfig(d_model=8, num_heads=2, num_layers=1)
    params = teo.init_params(cfg, 3)
    batch = teo.random_batch(cfg, 0, 5, 3)
    out = teo.run(cfg, params, batch)
    assert out["act.logits"].shape == (0, cfg.num_classes)
    assert float(out["act.loss"]) == 0.0
    assert not np.any(out["grad.head.weight"])


# ---- ops ------------------------------------------------------------------------------------------

def _op_args(g):
    t, s = g.tensors, g.spec
    op = g.op
    if op == "linear":
        return (t["input.x"], t["param.weight"], t.get("param.bias")), {"grad_y": t["grad.output.y"]}
    if op == "layer_norm":
        return ((t["input.x"], t["param.weight"], t["param.bias"]),
                {"layer_norm_eps": s["layer_norm_eps"], "grad_y": t["grad.output.y"]})
    if op == "rms_norm":
        return ((t["input.x"], t["param.weight"]),
                {"layer_norm_eps": s["layer_norm_eps"], "grad_y": t["grad.output.y"]})
    if op == "ffn":
        names = ("gate_weight", "gate_bias", "fc1_bias", "fc2_bias")
        kw = {n: t.get("param." + n.replace("_", ".")) for n in names}
        return ((t["input.x"], t["param.fc1.weight"], t["param.fc2.weight"]),
                dict(kw, ffn=s.get("ffn", "mlp"), activation=s["activation"],
                     grad_y=t["grad.output.y"]))
    if op == "lm_head":
        return ((t["input.x"], t["param.weight"], t["input.tokens"], t["input.lengths"],
                 t.get("param.bias")),
                {"label_smoothing": s["label_smoothing"], "grad_loss": t["grad.output.loss"]})
    if op == "softmax":
        return (t["input.x"],), {"visible": s["visible"], "grad_y": t["grad.output.y"]}
    if op == "activation":
        return (t["input.x"],), {"activation": s["activation"], "grad_y": t["grad.output.y"]}
    if op == "dropout":
        return (t["input.x"], t["input.mask"]), {"dropout": s["dropout"],
                                                 "grad_y": t["grad.output.y"]}
    variants = {k: s[k] for k in teo.ops.ATTENTION_VARIANT_KEYS if k in s}
    if op == "attention":
        kw = dict(variants, causal=s["causal"], scale=s["scale"], probs=s["probs"],
                  sinks=t.get("param.sinks"), grad_context=t["grad.output.context"])
        if "q_len" in s:  # queries and keys of their own lengths
            kw.update(kv_lengths=t["input.kv_lengths"], causal_align=s["causal_align"],
                      lse=s["lse"])
        if s.get("lse_grad"):  # one part of a split-KV backward
            kw.update(grad_lse=t["grad.output.lse"])
        lengths = t["input.q_lengths"] if "q_len" in s else t["input.lengths"]
        return (t["input.q"], t["input.k"], t["input.v"], lengths), kw
    if op == "attention_kvcache":  # forward only: no upstream gradient
        kw = dict(variants, causal=s["causal"], scale=s["scale"], lse=s["lse"],
                  sinks=t.get("param.sinks"))
        if s["layout"] == "paged":
            kw.update(k_pages=t["input.k_pages"], v_pages=t["input.v_pages"],
                      block_table=t["input.block_table"])
        else:
            kw.update(k_cache=t["input.k_cache"], v_cache=t["input.v_cache"])
        return (t["input.q"], t["input.k_new"], t["input.v_new"], t["input.cache_lengths"]), kw
    if op == "attention_merge":
        return ((t["input.context_parts"], t["input.lse_parts"]),
                {"grad_context": t["grad.output.context"], "grad_lse": t["grad.output.lse"]})
    if op == "embedding":
        return ((t["input.tokens"], t["param.weight"], t.get("param.pos_weight")),
                {"positional": s["positional"], "embed_scale": s["embed_scale"],
                 "token_types": t.get("input.token_types"), "type_weight": t.get("param.type_weight"),
                 "norm_weight": t.get("param.norm_weight"), "norm_bias": t.get("param.norm_bias"),
                 "norm": s.get("norm", "layernorm"), "layer_norm_eps": s.get("layer_norm_eps"),
                 "grad_x": t["grad.output.x"]})
    if op == "patch_embedding":
        return ((t["input.pixels"], t["param.weight"], t["param.bias"], t["param.cls_token"]),
                {"grad_x": t["grad.output.x"]})
    if op == "pooling":
        return ((t["input.x"], t["input.lengths"]),
                {"pooling": s["pooling"], "grad_pooled": t["grad.output.pooled"]})
    if op == "cross_entropy":
        return ((t["input.logits"], t["input.labels"]),
                {"label_smoothing": s["label_smoothing"], "grad_loss": t["grad.output.loss"]})
    if op == "moe_router":
        keys = ("router_scoring", "router_order", "norm_topk_prob", "routed_scaling_factor",
                "aux_losses", "router_groups", "topk_groups", "group_score")
        kw = {k: s[k] for k in keys if k in s}
        return ((t["input.x"], t["param.gate.weight"]),
                dict(kw, num_experts_per_tok=s["num_experts_per_tok"],
                     gate_bias=t.get("param.gate.bias"),
                     e_score_correction_bias=t.get("param.gate.e_score_correction_bias"),
                     topk_ids=t.get("input.moe.topk_ids"),
                     grad_topk_weights=t["grad.output.topk_weights"],
                     grad_aux_loss=t.get("grad.output.aux_loss"),
                     grad_z_loss=t.get("grad.output.z_loss")))
    params = {n[len("param."):]: a for n, a in t.items() if n.startswith("param.")}
    if op == "moe":
        kw = {k: s[k] for k in teo.ops.MOE_OPTIONS if k in s}
        return ((t["input.x"], params),
                dict(kw, num_experts_per_tok=s["num_experts_per_tok"],
                     topk_ids=t.get("input.moe.topk_ids"), grad_y=t["grad.output.y"],
                     grad_aux_loss=t.get("grad.output.aux_loss"),
                     grad_z_loss=t.get("grad.output.z_loss")))
    if op == "decoder_layer":
        opts = {k: s[k] for k in teo.ops.DECODER_LAYER_OPTIONS if k in s}
        return ((t["input.x"], t["input.lengths"], params),
                dict(opts, memory=t.get("input.memory"),
                     memory_lengths=t.get("input.memory_lengths"), grad_y=t["grad.output.y"]))
    masks = {n[len("input.mask."):]: a for n, a in t.items() if n.startswith("input.mask.")}
    # every option of the layer the case sets: the attention and block variants included
    opts = {k: s[k] for k in teo.ops.ENCODER_LAYER_OPTIONS if k in s}
    opts.update(variants)
    return (t["input.x"], t["input.lengths"], params), dict(opts, masks=masks,
                                                            grad_y=t["grad.output.y"])


def _float_operands(f):
    """Whether an op case's operands are all floats: teo.ops takes arrays of floats, and a
    quantized weight's or cache's packed tensors are read from the case file (golden.run_op)."""
    with open(os.path.join(OPS, f), "rb") as h:
        n = int.from_bytes(h.read(8), "little")
        spec = json.loads(json.loads(h.read(n))["__metadata__"]["spec"])
    return "weight_format" not in spec and "cache_format" not in spec


OP_CASES = sorted(f[:-len(".safetensors")] for f in os.listdir(OPS)
                  if f.endswith("_f64.safetensors") and "encoder_layer_dropout" not in f
                  and _float_operands(f))


@pytest.mark.parametrize("name", OP_CASES)
def test_each_op_gives_the_float64_op_cases_bits(name):
    g = op_case(name)
    args, kw = _op_args(g)
    out = getattr(teo.ops, g.op)(*args, backend="reference", **kw)
    for n, a in out.items():
        assert same_bits(a, g.tensors[n]), n


def test_quantized_cases_load_check_and_save_in_their_dtypes(tmp_path):
    # fp8 codes and scales load as uint8 bytes and are judged and saved as fp8 again
    for name in ("kvcache_fp8_e4m3_paged_f32", "linear_nvfp4_f32", "kvcache_int8_paged_f32"):
        g = op_case(name)
        assert teo.golden.check(g, g, require_all=True).passed, name
        out = {n: a for n, a in g.tensors.items()
               if n.startswith(("output.", "grad.input.", "grad.param."))}
        fp8 = {n: "F8_E4M3" for n in out if out[n].dtype == np.uint8}
        assert teo.golden.check(g, out, bits=fp8, require_all=True).passed, name
        bad = dict(out)
        k = next(n for n in out if n.startswith("output.k_")) if "kvcache" in name else None
        if k:
            bad[k] = np.zeros_like(out[k])
            report = teo.golden.check(g, bad, bits=fp8)
            assert not report.passed and k in str(report), name
        teo.golden.save(tmp_path / (name + ".safetensors"), g)
        again = teo.golden.load(tmp_path / (name + ".safetensors"))
        for n in g.tensors:
            assert same_bits(g.tensors[n], again.tensors[n]), n


def test_ops_in_float32_pass_the_float32_case():
    g = op_case("attention_odd_dh_scale_f32")
    args, kw = _op_args(g)
    out = getattr(teo.ops, g.op)(*args, **kw)
    report = teo.golden.check(g, {n: a.astype(np.float32) for n, a in out.items()},
                              require_all=True)
    assert report.passed, str(report)


def test_op_case_in_memory_equals_the_cli_file(tmp_path):
    spec = {"batch": 1, "num_heads": 2, "seq_len": 5, "d_head": 3, "lengths": [4],
            "causal": True, "dtype": "float64", "seed": 9}
    g = teo.golden.op_case("attention", **spec)
    (tmp_path / "s.json").write_text(json.dumps(spec))
    subprocess.run([TEO_BIN, "golden", "op", "--op", "attention", "--spec",
                    str(tmp_path / "s.json"), "--out", str(tmp_path / "a.safetensors")],
                   check=True, capture_output=True)
    from_cli = teo.golden.load(tmp_path / "a.safetensors")
    assert g.metadata == from_cli.metadata
    for n in from_cli.tensors:
        assert same_bits(g.tensors[n], from_cli.tensors[n]), n


# ---- golden files and the checker ---------------------------------------------------------------

def test_save_load_round_trip_and_no_overwrite(tmp_path):
    path = tmp_path / "t.safetensors"
    tensors = {"a": np.arange(6, dtype=np.float64).reshape(2, 3)[:, ::2],  # strided: copied
               "b": np.array([1, 2], dtype=np.int64), "h": np.ones(3, dtype=np.float16)}
    teo.golden.save(path, tensors, {"who": "me"})
    g = teo.golden.load(path)
    assert g.metadata == {"who": "me"}
    assert same_bits(g.tensors["a"], np.ascontiguousarray(tensors["a"]))
    assert g.tensors["h"].dtype == np.float16
    with pytest.raises(teo.FileError, match="already exists"):
        teo.golden.save(path, tensors)
    teo.golden.save(path, {"a": np.zeros(1)}, force=True)
    assert list(teo.golden.load(path).tensors) == ["a"]


def test_bf16_bit_patterns_and_ml_dtypes(tmp_path):
    path = tmp_path / "b.safetensors"
    bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0 and -2.0
    teo.golden.save(path, {"x": bits}, bits={"x": "BF16"})
    x = teo.golden.load(path).tensors["x"]
    assert [float(v) for v in x.astype(np.float32)] == [1.0, -2.0] or x.dtype == np.uint16
    with pytest.raises(teo.ConfigError, match="bits="):
        teo.golden.save(path, {"x": bits}, force=True)


def test_check_takes_paths_goldens_and_dicts_and_str_is_the_clis_text(tmp_path):
    golden_path = os.path.join(GOLDEN, "post_gelu_mean_f32.safetensors")
    g = teo.golden.load(golden_path)
    cand = {n: a.copy() for n, a in g.tensors.items() if n.startswith(("act.", "grad."))}
    assert teo.golden.check(golden_path, cand, require_all=True).passed
    cand["act.layers.1.q"][0, 0, 0, 0] += 1e-3
    bad = tmp_path / "post_gelu_mean_f32.safetensors"
    teo.golden.save(bad, cand)
    for c in (str(bad), teo.golden.load(bad)):
        r = teo.golden.check(golden_path, c)
        assert not r.passed and r.exit_code == 1
        assert r.first_divergence == "layers.1.q"
        assert [t.status for t in r.tensors if t.name == "act.layers.1.q"] == ["fail"]
        assert json.loads(r.to_json())["cases"][0]["failed"] == r.counts["failed"] >= 1
    cli = subprocess.run([TEO_BIN, "golden", "check", "--golden", golden_path, "--candidate",
                          str(bad)], capture_output=True, text=True)
    assert cli.returncode == 1
    assert str(teo.golden.check(golden_path, str(bad))) == cli.stdout


def test_check_options_precision_only_and_tolerances():
    g = op_case("attention_bf16")
    cand = {n: a for n, a in g.tensors.items() if n.startswith(("output.", "grad.input."))}
    r = teo.golden.check(g, cand, precision="bf16")
    assert r.passed and r.precision == "bf16"
    r = teo.golden.check(g, {"output.context": cand["output.context"]}, only="forward")
    assert r.passed and r.optional_missing == ["output.scores", "output.probs"]
    with pytest.raises(teo.ConfigError):
        teo.golden.check(g, cand, only="sideways")
    with pytest.raises(teo.ConfigError):
        teo.golden.check(g, cand, precision="fp4")


def test_check_judges_a_precision_case_in_its_precision_and_says_why_not():
    # attention_bf16's float32 outputs against the bf16 case: judged as bf16, its own precision
    g = op_case("attention_bf16")
    cand = {n: a for n, a in g.tensors.items() if n.startswith(("output.", "grad.input."))}
    r = teo.golden.check(g, cand)
    assert r.passed and r.precision == "bf16" and r.notes == []
    # the same values as float16: the dtypes imply fp16, and the note says so
    half = {n: a.astype(np.float16) for n, a in cand.items() if np.isfinite(a).all()}
    r = teo.golden.check(g, half)
    assert r.precision == "fp16"
    assert len(r.notes) == 1 and "the golden is a bf16 case" in r.notes[0]
    assert str(r).splitlines()[1] == "  note: " + r.notes[0]


def test_check_fp8_recipe_k():
    # float32 outputs are more accurate than the fp8 recipe, but not what it computes: the recipe
    # rule fails them, and fp8_recipe_k=inf leaves the budget alone to judge them
    g = op_case("linear_fp8_tensor")
    cand = {n: a for n, a in g.tensors.items() if n.startswith(("output.", "grad."))}
    r = teo.golden.check(g, cand, precision="fp8")
    assert not r.passed and r.precision == "fp8"
    assert "off the fp8 recipe" in str(r)
    r = teo.golden.check(g, cand, precision="fp8", fp8_recipe_k=float("inf"))
    assert r.passed
    with pytest.raises(teo.ConfigError, match="fp8_recipe_k"):
        teo.golden.check(g, cand, precision="fp8", fp8_recipe_k=-1)


def test_assert_matches_golden():
    g = case("post_relu_cls_f64")
    cand = {n: a.copy() for n, a in g.tensors.items() if n.startswith(("act.", "grad."))}
    teo.testing.assert_matches_golden(g, cand, require_all=True)
    cand["grad.head.bias"] = cand["grad.head.bias"] * 2
    with pytest.raises(AssertionError, match="first divergence: grad.head.bias"):
        teo.testing.assert_matches_golden(g, cand)


# ---- errors ---------------------------------------------------------------------------------------

def test_error_mapping(tmp_path):
    assert issubclass(teo.ConfigError, ValueError) and issubclass(teo.ShapeError, ValueError)
    assert issubclass(teo.InputError, ValueError) and issubclass(teo.FormatError, OSError)
    cfg = teo.ModelConfig(d_model=8, num_heads=2, num_layers=1)
    params = teo.init_params(cfg, 1)
    batch = teo.random_batch(cfg, 2, 4, 1)
    with pytest.raises(teo.ConfigError, match="layers.0.attn.q.weight"):
        teo.run(cfg, {n: a for n, a in params.items() if n != "layers.0.attn.q.weight"}, batch)
    wrong = dict(params, **{"head.bias": np.zeros(7)})
    with pytest.raises(teo.ShapeError, match="head.bias"):
        teo.run(cfg, wrong, batch)
    with pytest.raises(teo.ConfigError, match="float32 or all float64"):
        teo.run(cfg, dict(params, **{"head.bias": params["head.bias"].astype(np.float32)}), batch)
    with pytest.raises(teo.ConfigError, match="unknown key"):
        teo.run(cfg, dict(params, extra=np.zeros(1)), batch)
    bad = dict(batch, tokens=batch["tokens"] + 1000)
    with pytest.raises(teo.InputError):
        teo.run(cfg, params, bad)
    with pytest.raises(teo.ConfigError, match="tokens"):
        teo.run(cfg, params, dict(batch, tokens=batch["tokens"].astype(float)))
    with pytest.raises(teo.ShapeError, match="tokens"):
        teo.run(cfg, params, {"lengths": batch["lengths"], "labels": batch["labels"]})
    with pytest.raises(teo.ConfigError, match="precision"):
        teo.run(cfg, params, batch, precision="fp12")
    with pytest.raises(teo.ConfigError, match="backend"):
        teo.run(cfg, params, batch, backend="gpu")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(teo.FormatError):
        teo.golden.load(junk)
    with pytest.raises(teo.FileError):
        teo.golden.load(tmp_path / "missing.safetensors")
    # a golden is validated against its contract before it is read: a probs tensor of the wrong
    # shape is named, never read past its end
    g = teo.golden.load(os.path.join(GOLDEN, "post_gelu_mean_f64.safetensors"))
    meta = dict(g.metadata)
    short = dict(g.tensors, **{"act.layers.0.probs": g.tensors["act.layers.0.probs"][:1]})
    teo.golden.save(tmp_path / "short.safetensors", short, meta)
    with pytest.raises(teo.FormatError, match="act.layers.0.probs has shape"):
        teo.golden.load(tmp_path / "short.safetensors")
    with pytest.raises(teo.FormatError, match="act.layers.0.probs"):
        teo.golden.check(tmp_path / "short.safetensors", g.tensors)
    with pytest.raises(teo.ConfigError, match="dtype complex128"):
        teo.golden.save(tmp_path / "c.safetensors", {"z": np.zeros(2, dtype=np.complex128)})
    with pytest.raises(teo.ConfigError, match="unknown op"):
        teo.golden.op_case("conv", dtype="float64", seed=0)
    with pytest.raises(teo.ShapeError):
        teo.ops.attention(np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 3, 2)),
                          [4])
    with pytest.raises(teo.ConfigError, match="mix"):
        teo.ops.linear(np.zeros((2, 3)), np.zeros((4, 3), dtype=np.float32))


# ---- memory and threads -----------------------------------------------------------------------------

def _rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def test_ten_thousand_calls_do_not_grow_memory():
    x = np.random.default_rng(0).standard_normal((4, 5))
    w = np.random.default_rng(1).standard_normal((3, 5))
    cfg = teo.ModelConfig(d_model=8, num_heads=2, num_layers=1)
    for _ in range(500):
        teo.ops.linear(x, w)
    before = _rss_kib()
    for i in range(10000):
        teo.ops.linear(x, w)
        if i % 10 == 0:
            teo.init_params(cfg, i)
    grown = _rss_kib() - before
    assert grown < 8 * 1024, "RSS grew by %d KiB over 10,000 calls" % grown


def test_concurrent_calls_from_python_threads_are_correct():
    names = ["post_gelu_mean_f64", "causal_pre_f64", "learned_pe_f64", "one_layer_f64"]
    goldens = [case(n) for n in names]
    errors = []

    def work(g):
        try:
            params = {n[6:]: a for n, a in g.tensors.items() if n.startswith("param.")}
            batch = {k: g.tensors["input." + k] for k in ("tokens", "lengths", "labels")}
            for _ in range(3):
                out = teo.run(g.config, params, batch, train=True, dropout_seed=g.case["seed"],
                              backend="reference")
                for n, a in out.items():
                    if not same_bits(a, g.tensors[n]):
                        errors.append((g.path, n))
                        return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((g.path, repr(e)))

    threads = [threading.Thread(target=work, args=(g,)) for g in goldens * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
