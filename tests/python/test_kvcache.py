"""teo.ops.attention_kvcache and teo.ops.attention_merge: a paged cache gives the contiguous
cache's bits, the append writes exactly the new tokens' slots, a chunked prefill through the cache
is one pass of attention, merging split keys is attention over all of them (an empty split
changing nothing), and bad inputs are named errors.

Run: PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python (ctest does).
"""

import numpy as np
import pytest

import teo

B, H, HKV, DH, DV = 3, 4, 2, 8, 6  # GQA 2, and a value head size of its own


def rand(rng, *shape):
    return rng.standard_normal(shape)


def new_tokens(rng, sq):
    return rand(rng, B, H, sq, DH), rand(rng, B, HKV, sq, DH), rand(rng, B, HKV, sq, DV)


def paged_copy(cache, table, page_size, num_pages, rng):
    """The pages of a contiguous cache (B, Hkv, max_len, D) under block_table table: token t of
    sequence b at pages[table[b, t // page_size], t % page_size]; spare pages random."""
    pages = rand(rng, num_pages, page_size, cache.shape[1], cache.shape[3])
    for b in range(cache.shape[0]):
        for t in range(table.shape[1] * page_size):
            pages[table[b, t // page_size], t % page_size] = cache[b, :, t]
    return pages


def random_table(rng, max_pages, spare):
    """A block table of B rows of max_pages distinct pages, drawn from B * max_pages + spare."""
    num_pages = B * max_pages + spare
    return rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32), \
        num_pages


@pytest.mark.parametrize("backend", ["reference", "simd"])
def test_paged_and_contiguous_caches_give_the_same_bits(backend):
    rng = np.random.default_rng(1)
    page_size, max_pages, sq = 4, 5, 3
    max_len = page_size * max_pages
    cache = [5, 0, max_len - sq]  # the last one fills the cache
    q, k_new, v_new = new_tokens(rng, sq)
    k_cache, v_cache = rand(rng, B, HKV, max_len, DH), rand(rng, B, HKV, max_len, DV)
    table, num_pages = random_table(rng, max_pages, spare=3)
    k_pages = paged_copy(k_cache, table, page_size, num_pages, rng)
    v_pages = paged_copy(v_cache, table, page_size, num_pages, rng)

    contiguous = teo.ops.attention_kvcache(q, k_new, v_new, cache, k_cache=k_cache,
                                           v_cache=v_cache, backend=backend)
    paged = teo.ops.attention_kvcache(q, k_new, v_new, cache, k_pages=k_pages, v_pages=v_pages,
                                      block_table=table, backend=backend)
    for name in ("output.context", "output.lse"):
        assert paged[name].tobytes() == contiguous[name].tobytes(), name
    # and the updated caches hold the same tokens
    used = np.zeros(num_pages, dtype=bool)
    used[table.reshape(-1)] = True
    for x in ("k", "v"):
        again = paged_copy(contiguous["output.%s_cache" % x], table, page_size, num_pages, rng)
        assert np.array_equal(paged["output.%s_pages" % x][used], again[used]), x


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_append_writes_the_new_tokens_and_nothing_else(layout):
    rng = np.random.default_rng(2)
    page_size, max_pages, sq = 3, 4, 2
    cache = np.array([0, 7, 10])  # 10 + 2 fills all 4 pages of 3
    q, k_new, v_new = new_tokens(rng, sq)
    if layout == "contiguous":
        k, v = rand(rng, B, HKV, 12, DH), rand(rng, B, HKV, 12, DV)
        out = teo.ops.attention_kvcache(q, k_new, v_new, cache, k_cache=k, v_cache=v)
        k_out, v_out = out["output.k_cache"], out["output.v_cache"]

        def slot(b, t):
            return (b, slice(None), t)
    else:
        table, num_pages = random_table(rng, max_pages, spare=2)
        k, v = rand(rng, num_pages, page_size, HKV, DH), rand(rng, num_pages, page_size, HKV, DV)
        out = teo.ops.attention_kvcache(q, k_new, v_new, cache, k_pages=k, v_pages=v,
                                        block_table=table)
        k_out, v_out = out["output.k_pages"], out["output.v_pages"]

        def slot(b, t):
            return (table[b, t // page_size], t % page_size)
    k_expect, v_expect = k.copy(), v.copy()
    for b in range(B):
        for i in range(sq):
            k_expect[slot(b, cache[b] + i)] = k_new[b, :, i]
            v_expect[slot(b, cache[b] + i)] = v_new[b, :, i]
    assert np.array_equal(k_out, k_expect) and np.array_equal(v_out, v_expect)
    assert not np.array_equal(k_out, k)  # the new tokens did land


@pytest.mark.parametrize("variants", [{}, {"positional": "rope"}], ids=["plain", "rope"])
def test_a_chunked_prefill_through_the_cache_is_one_pass_of_attention(variants):
    rng = np.random.default_rng(3)
    first, second = 5, 4  # two chunks of one 9-token prompt per sequence
    s = first + second
    q, k, v = rand(rng, B, H, s, DH), rand(rng, B, HKV, s, DH), rand(rng, B, HKV, s, DV)
    whole = teo.ops.attention(q, k, v, causal=True, causal_align="bottom_right", lse=True,
                              **variants)

    k_cache, v_cache = np.zeros((B, HKV, s, DH)), np.zeros((B, HKV, s, DV))
    rows = [slice(0, first), slice(first, s)]
    for n, r in enumerate(rows):
        step = teo.ops.attention_kvcache(q[:, :, r], k[:, :, r], v[:, :, r], [r.start] * B,
                                         k_cache=k_cache, v_cache=v_cache, **variants)
        k_cache, v_cache = step["output.k_cache"], step["output.v_cache"]  # fed back
        for name in ("output.context", "output.lse"):
            np.testing.assert_allclose(step[name], whole[name][:, :, r], rtol=0, atol=1e-12,
                                       err_msg="chunk %d, %s" % (n, name))
    if variants:  # the cache holds the rotated keys: the attention op's own
        np.testing.assert_allclose(k_cache, whole["output.k_rot"], rtol=0, atol=1e-12)
    else:
        assert np.array_equal(k_cache, k) and np.array_equal(v_cache, v)


def test_merging_two_halves_of_the_keys_is_attention_over_all_of_them():
    rng = np.random.default_rng(4)
    sq, skv, cut = 3, 11, 4
    q, k, v = rand(rng, B, H, sq, DH), rand(rng, B, HKV, skv, DH), rand(rng, B, HKV, skv, DV)
    whole = teo.ops.attention(q, k, v, lse=True)
    parts = [teo.ops.attention(q, k[:, :, r], v[:, :, r], lse=True)
             for r in (slice(0, cut), slice(cut, skv))]
    merged = teo.ops.attention_merge(np.stack([p["output.context"] for p in parts]),
                                     np.stack([p["output.lse"] for p in parts]))
    for name in ("output.context", "output.lse"):
        np.testing.assert_allclose(merged[name], whole[name], rtol=0, atol=1e-12, err_msg=name)


def test_an_empty_part_changes_nothing_and_gets_no_gradient():
    rng = np.random.default_rng(5)
    parts, sq = 3, 2
    context, lse = rand(rng, parts, B, H, sq, DV), rand(rng, parts, B, H, sq)
    grads = {"grad_context": rand(rng, B, H, sq, DV), "grad_lse": rand(rng, B, H, sq)}
    # a fourth part, second in line, over no keys: lse -inf (its context is never read)
    with_empty_c = np.insert(context, 1, rand(rng, B, H, sq, DV), axis=0)
    with_empty_l = np.insert(lse, 1, -np.inf, axis=0)
    plain = teo.ops.attention_merge(context, lse, **grads)
    padded = teo.ops.attention_merge(with_empty_c, with_empty_l, **grads)
    for name in ("output.context", "output.lse"):
        assert padded[name].tobytes() == plain[name].tobytes(), name
    for name in ("grad.input.context_parts", "grad.input.lse_parts"):
        g = padded[name]
        assert not np.any(g[1]), name  # zero, and not NaN
        assert np.delete(g, 1, axis=0).tobytes() == plain[name].tobytes(), name


# ---- bad inputs ---------------------------------------------------------------------------------

def _step():
    rng = np.random.default_rng(6)
    q, k_new, v_new = new_tokens(rng, 1)
    caches = {"k_cache": np.zeros((B, HKV, 8, DH)), "v_cache": np.zeros((B, HKV, 8, DV))}
    pages = {"k_pages": np.zeros((6, 4, HKV, DH)), "v_pages": np.zeros((6, 4, HKV, DV)),
             "block_table": np.arange(6).reshape(B, 2)}
    return (q, k_new, v_new, [1, 2, 3]), caches, pages


def test_both_caches_are_a_config_error():
    args, caches, pages = _step()
    with pytest.raises(teo.ConfigError, match="not both"):
        teo.ops.attention_kvcache(*args, **caches, **pages)


def test_pages_without_a_block_table_are_a_config_error():
    args, _, pages = _step()
    del pages["block_table"]
    with pytest.raises(teo.ConfigError, match="a paged cache needs k_pages, v_pages and "
                                              "block_table"):
        teo.ops.attention_kvcache(*args, **pages)


def test_a_cache_too_short_for_the_step_is_a_shape_error():
    args, caches, pages = _step()
    with pytest.raises(teo.ShapeError, match="cache_lengths"):
        teo.ops.attention_kvcache(*args[:3], [1, 2, 8], **caches)  # 8 + 1 > max_len 8
    with pytest.raises(teo.ShapeError, match="needs 3 pages"):
        teo.ops.attention_kvcache(*args[:3], [1, 2, 8], **pages)  # 2 pages of 4 per sequence


def test_a_misspelled_keyword_names_the_closest_one():
    args, caches, _ = _step()
    with pytest.raises(TypeError) as e:
        teo.ops.attention_kvcache(*args, k_cahce=caches["k_cache"], v_cache=caches["v_cache"])
    assert str(e.value) == ("teo.ops.attention_kvcache() got an unexpected keyword argument "
                            "'k_cahce'; did you mean 'k_cache'?")
    with pytest.raises(TypeError, match="did you mean 'sliding_window'"):
        teo.ops.attention_kvcache(*args, **caches, sliding_windw=4)
    with pytest.raises(TypeError) as e:
        teo.ops.attention_merge(np.zeros((1, 1, 1, 1, 1)), np.zeros((1, 1, 1, 1)),
                                grad_contxt=None)
    assert str(e.value) == ("teo.ops.attention_merge() got an unexpected keyword argument "
                            "'grad_contxt'; did you mean 'grad_context'?")


def test_floats_for_integers_are_a_config_error_not_truncated():
    args, _, pages = _step()
    with pytest.raises(teo.ConfigError, match="block_table must hold integers, got float64"):
        teo.ops.attention_kvcache(*args, **dict(pages, block_table=pages["block_table"] + 0.5))
    with pytest.raises(teo.ConfigError, match="cache_lengths must hold integers"):
        teo.ops.attention_kvcache(*args[:3], [1.5, 2, 3], **pages)


def test_a_wrong_rank_or_mismatched_cache_is_a_shape_error_naming_it():
    args, caches, pages = _step()
    with pytest.raises(teo.ShapeError, match=r"q must be \(B, H, Sq, Dh\), got shape \(3, 4, 1\)"):
        teo.ops.attention_kvcache(args[0][..., 0], *args[1:], **caches)
    with pytest.raises(teo.ShapeError, match=r"context_parts must be \(P, B, H, Sq, Dv\)"):
        teo.ops.attention_merge(np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1)))
    with pytest.raises(teo.ShapeError, match="teo.ops.attention_kvcache: input.v_pages"):
        teo.ops.attention_kvcache(*args, **dict(pages, v_pages=np.zeros((6, 2, HKV, DV))))


def test_rows_past_a_sequences_keys_are_never_read():
    # a contiguous cache that the longest sequence fills, NaN past the shorter one's keys (an
    # uninitialised cache): its context is finite and the paged cache's
    rng = np.random.default_rng(3)
    q, k_new, v_new = new_tokens(rng, 1)
    k_cache, v_cache = rand(rng, B, HKV, 6, DH), rand(rng, B, HKV, 6, DV)
    lengths = [5, 2, 0]
    for b, n in enumerate(lengths):
        k_cache[b, :, n + 1:] = np.nan
        v_cache[b, :, n + 1:] = np.nan
    out = teo.ops.attention_kvcache(q, k_new, v_new, lengths, k_cache=k_cache, v_cache=v_cache)
    assert np.isfinite(out["output.context"]).all() and np.isfinite(out["output.lse"]).all()
    table = np.arange(B * 2).reshape(B, 2).astype(np.int32)
    paged = teo.ops.attention_kvcache(q, k_new, v_new, lengths, block_table=table,
                                      k_pages=paged_copy(k_cache, table, 3, B * 2, rng),
                                      v_pages=paged_copy(v_cache, table, 3, B * 2, rng))
    assert np.array_equal(out["output.context"], paged["output.context"])


def test_attentions_keys_past_kv_lengths_are_never_read():
    # NaN in the padding of k and v (an uninitialised buffer): the results and gradients are those
    # of zeros there, bit for bit
    rng = np.random.default_rng(4)
    q = rand(rng, B, H, 2, DH)
    k, v = rand(rng, B, HKV, 7, DH), rand(rng, B, HKV, 7, DV)
    kv_lengths = [7, 3, 0]
    clean_k, clean_v, bad_k, bad_v = k.copy(), v.copy(), k.copy(), v.copy()
    for b, n in enumerate(kv_lengths):
        clean_k[b, :, n:] = clean_v[b, :, n:] = 0
        bad_k[b, :, n:] = bad_v[b, :, n:] = np.nan
    for probs in (True, False):
        clean = teo.ops.attention(q, clean_k, clean_v, kv_lengths=kv_lengths, causal=True,
                                  probs=probs)
        bad = teo.ops.attention(q, bad_k, bad_v, kv_lengths=kv_lengths, causal=True, probs=probs)
        for name in ("output.context", "output.lse", "grad.input.q"):
            assert np.array_equal(clean[name], bad[name]), name
        for name in ("grad.input.k", "grad.input.v"):
            assert np.isfinite(bad[name]).all() and np.array_equal(clean[name], bad[name]), name
