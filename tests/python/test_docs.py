"""docs/python.md as written: its ```python blocks run in order, in one namespace, in a temporary
working directory holding the repository's golden/ (their asserts must hold), and the signatures
it gives are the program's.

Run: PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python (ctest does).
"""

import ast
import importlib.util
import inspect
import os
import re

import pytest

import teo
from conftest import GOLDEN, ROOT

DOC = os.path.join(ROOT, "docs", "python.md")


def python_blocks(path):
    """[(first line number, code)] of the ```python blocks of a Markdown file."""
    blocks, code, start = [], None, 0
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if code is None and line.rstrip() == "```python":
                code, start = [], number + 1
            elif code is not None and line.rstrip() == "```":
                blocks.append((start, "".join(code)))
                code = None
            elif code is not None:
                code.append(line)
    assert code is None, "%s: the block from line %d is not closed" % (path, start)
    return blocks


def test_the_python_blocks_of_python_md_run(tmp_path, monkeypatch):
    blocks = python_blocks(DOC)
    assert len(blocks) >= 5, "expected the doc's python blocks, found %d" % len(blocks)
    os.symlink(GOLDEN, tmp_path / "golden")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TEO_BACKEND", raising=False)
    has_torch = importlib.util.find_spec("torch") is not None
    namespace = {"__name__": "python_md"}
    ran = 0
    for start, code in blocks:
        if "import torch" in code and not has_torch:
            continue  # (torch is installed where CI runs this)
        try:
            exec(compile(code, "%s:%d" % (DOC, start), "exec"), namespace)
        except Exception as e:
            pytest.fail("docs/python.md, the block at line %d: %s: %s\n%s"
                        % (start, type(e).__name__, e, code))
        ran += 1
    assert ran >= len(blocks) - 1
    # what the blocks promise, checked here too
    assert (tmp_path / "candidates" / "post_gelu_mean_f64.safetensors").exists() or not has_torch


# The functions whose signatures the doc gives, by the name it calls them.
FUNCTIONS = dict({"run": teo.run, "init_params": teo.init_params, "generate": teo.generate,
                  "random_batch": teo.random_batch, "load": teo.golden.load,
                  "save": teo.golden.save, "op_case": teo.golden.op_case,
                  "check": teo.golden.check,
                  "assert_matches_golden": teo.testing.assert_matches_golden},
                 **{n: getattr(teo.ops, n) for n in
                    ("linear", "layer_norm", "rms_norm", "softmax", "activation", "ffn", "dropout",
                     "attention",
                     "attention_kvcache", "attention_merge", "embedding", "patch_embedding",
                     "pooling",
                     "cross_entropy", "lm_head", "encoder_layer", "decoder_layer")})
# One parameter as the doc writes it: name, name=default (the default may be left out), *, **name.
PARAM = r"(?:\*\*?\w+|\*|\w+(?:=[^,()]*)?)"
SIGNATURE = re.compile(r"`(?:teo\.(?:golden\.|ops\.|testing\.)?)?(\w+)\((%s(?:, %s)*)?\)`"
                       % (PARAM, PARAM))


def documented_signatures():
    with open(DOC) as f:
        text = f.read().replace("\n", " ")
    return [(name, args or "") for name, args in SIGNATURE.findall(text) if name in FUNCTIONS]


def test_the_signatures_in_python_md_are_the_programs():
    found = documented_signatures()
    assert {name for name, _ in found} == set(FUNCTIONS), "signatures missing from the doc"
    for name, args in found:
        params = inspect.signature(FUNCTIONS[name]).parameters.values()
        # the doc leaves out the upstream gradients (grad_*) of the ops, and their **kw
        real = [p for p in params if not p.name.startswith("grad_")]
        doc = [a.strip() for a in args.split(",") if a.strip()]
        if real and real[-1].kind == real[-1].VAR_KEYWORD and not (doc and doc[-1][:2] == "**"):
            real = real[:-1]
        # the program's parameters as (name, default), with "*" where keyword-only ones begin
        shown = []
        for p in real:
            if p.kind == p.KEYWORD_ONLY and "*" not in [n for n, _ in shown]:
                shown.append(("*", p.empty))
            shown.append(("**" if p.kind == p.VAR_KEYWORD else p.name, p.default))
        where = "docs/python.md: %s(%s); the program has %s" % (name, args, [n for n, _ in shown])
        assert len(doc) == len(shown), where
        for d, (n, default) in zip(doc, shown):
            if n == "**":
                assert d.startswith("**"), where
                continue
            d_name, eq, d_default = d.partition("=")
            assert d_name == n and bool(eq) == (default is not inspect.Parameter.empty), where
            if d_default:  # a default the doc spells out
                assert ast.literal_eval(d_default) == default, where
