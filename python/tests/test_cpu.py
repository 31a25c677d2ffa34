"""flexc's Python module on the CPU: variants, errors, BlockMasks, ahead-of-time compilation and
the float64 reference, against numpy (no GPU needed)."""
import json
import math

import numpy as np
import pytest

import flexc

RNG = np.random.default_rng()


def test_catalogue_and_expressions():
    names = flexc.Variant.catalogue_names()
    assert {"noop", "causal", "alibi", "document", "sliding_window"} <= set(names)
    alibi = flexc.Variant.from_catalogue("@alibi")
    assert alibi.name == "alibi"
    assert [c.name for c in alibi.captures] == ["slope"]
    assert alibi.captures[0].dims == ["H"]
    v = flexc.Variant.from_strings("score * 2.0", "q_idx >= kv_idx - window",
                                   params=[flexc.ParamSpec("window", "int", 16)], name="mine")
    assert v.name == "mine" and v.params[0].name == "window" and v.params[0].default == 16
    assert v.score_grad == "2.0"
    assert v.precision == flexc.Precision.FAST
    assert v.with_precision(flexc.Precision.EXACT).precision == flexc.Precision.EXACT
    assert v.with_precision(flexc.Precision.APPROX).precision == flexc.Precision.APPROX
    both = flexc.Variant.from_catalogue("causal") & flexc.Variant.from_catalogue("sliding_window")
    assert "window" in [p.name for p in both.params]


def test_errors_are_value_errors_with_flexc_diagnostics():
    with pytest.raises(flexc.Error) as e:
        flexc.Variant.from_strings("score + nope", "true")
    assert isinstance(e.value, ValueError)
    assert "unknown name 'nope'" in str(e.value) and "^" in str(e.value)
    with pytest.raises(flexc.Error, match="catalogue"):
        flexc.Variant.from_catalogue("no_such_variant")
    with pytest.raises(flexc.Error, match="unknown kernel 'attention_nope'"):
        flexc.compile(flexc.Variant.from_catalogue("noop"), "attention_nope", arch="sm_90")


def test_json_config():
    config = {"name": "banded", "score_mod": "score", "mask_mod": "abs(q_idx - kv_idx) <= band",
              "params": [{"name": "band", "type": "int", "default": 3, "kind": "runtime"}]}
    v = flexc.Variant.from_json(json.dumps(config))
    assert v.name == "banded" and v.mask_mod == "abs(q_idx - kv_idx) <= band"


def test_block_mask_causal_tiles_and_lists():
    causal = flexc.Variant.from_catalogue("causal")
    m = flexc.create_block_mask(causal, 1, 1, 1000, 1000)
    assert m.num_tiles == (8, 8)
    assert m.count(flexc.TileKind.PARTIAL) == 8  # the diagonal
    assert m.count(flexc.TileKind.FULL) == 28
    assert m.sparsity() == pytest.approx(100 * 28 / 64)
    kv_num, kv_idx, full_num, full_idx = m.kv_lists()
    assert kv_num.shape == (1, 1, 8) and kv_idx.shape == (1, 1, 8, 8)
    assert list(kv_num[0, 0]) == [1] * 8
    assert list(full_num[0, 0]) == list(range(8))
    assert all(kv_idx[0, 0, q, 0] == q for q in range(8))
    # Chunked prefill: rows at positions 256.. are the full mask's rows from q tile 2.
    chunk = flexc.create_block_mask(causal, 1, 1, 300, 1000, q_offset=256)
    assert chunk.q_offset == 256
    assert [chunk.tile(0, 0, 0, k) for k in range(8)] == [m.tile(0, 0, 2, k) for k in range(8)]
    # A block of the sequence (context parallelism): queries 512.., keys 256.. of its 1024.
    block = flexc.create_block_mask(causal, 1, 1, 256, 512, q_offset=512, kv_offset=256,
                                    seq_q_len=1024, seq_kv_len=1024)
    assert (block.kv_offset, block.seq_q_len, block.seq_kv_len) == (256, 1024, 1024)
    assert [[block.tile(0, 0, q, k) for k in range(4)] for q in range(2)] == \
        [[m.tile(0, 0, 4 + q, 2 + k) for k in range(4)] for q in range(2)]
    with pytest.raises(flexc.Error, match="seq_kv_len = 700 must hold kv_offset"):
        flexc.create_block_mask(causal, 1, 1, 256, 512, kv_offset=256, seq_kv_len=700)


def test_block_mask_with_captures_and_params():
    doc = flexc.Variant.from_catalogue("document")
    ids = np.repeat(np.arange(4, dtype=np.int32), 250)  # four documents of 250 tokens
    m = flexc.create_block_mask(doc, 1, 1, 1000, 1000, captures={"doc": ids}, q_tile=64,
                                kv_tile=64)
    kinds = {(q, k): m.tile(0, 0, q, k) for q in range(16) for k in range(16)}
    for (q, k), kind in kinds.items():
        dq = {i // 250 for i in range(q * 64, min(q * 64 + 64, 1000))}
        dk = {i // 250 for i in range(k * 64, min(k * 64 + 64, 1000))}
        expect = (flexc.TileKind.EMPTY if not dq & dk else
                  flexc.TileKind.FULL if len(dq) == 1 and dq == dk else flexc.TileKind.PARTIAL)
        assert kind == expect, (q, k)
    with pytest.raises(flexc.Error, match="doc"):
        flexc.create_block_mask(doc, 1, 1, 1000, 1000, captures={"doc": ids[:999]})
    with pytest.raises(flexc.Error, match="not one flexc reads"):
        flexc.create_block_mask(doc, 1, 1, 1000, 1000, captures={"doc": ids.astype(np.int64)})
    window = flexc.Variant.from_catalogue("sliding_window")
    narrow = flexc.create_block_mask(window, 1, 1, 1024, 1024, params={"window": 128})
    wide = flexc.create_block_mask(window, 1, 1, 1024, 1024, params={"window": 1024})
    assert narrow.sparsity() > wide.sparsity()
    with pytest.raises(flexc.Error, match="window"):
        flexc.create_block_mask(window, 1, 1, 64, 64, params={"window": 1.5})


def test_ring_plan():
    causal = flexc.Variant.from_catalogue("causal")
    zigzag = flexc.plan_ring(causal, ranks=4, seq_len=1024)
    assert zigzag.chunks[0] == [0, 7] and zigzag.rank_tiles == [9, 9, 9, 9]
    assert zigzag.imbalance == 1.0 and zigzag.computed_blocks == 16
    contiguous = flexc.plan_ring(causal, ranks=4, seq_len=1024, sharding="contiguous",
                                 q_heads=8, kv_heads=2, head_dim=64)
    assert contiguous.skipped_blocks == 6 and contiguous.skipped_sends == 6
    step1 = contiguous.steps[1]
    assert [b.kv_rank for b in step1.blocks] == [3, 0, 1, 2]
    assert [b.computes for b in step1.blocks] == [False, True, True, True]
    assert step1.bytes_sent == step1.sends * 2 * 2 * 256 * 64 * 2
    # The backward's dK / dV (float32): ranks 1..3 hold a visiting shard at step 1; rank 3's
    # (shard 2) goes home, no later rank needs it.
    assert step1.grad_to == [-1, 2, 3, 2]
    assert step1.grad_bytes_sent == step1.grad_sends * 2 * 2 * 256 * 64 * 4
    # Zigzag over 2 ranks, step 1: rank 0 touches both chunks of rank 1's shard and sends the
    # first while the second's block runs; rank 1 touches one of rank 0's and sends only it.
    two = flexc.plan_ring(causal, ranks=2, seq_len=1024).steps[1]
    assert two.grad_chunks == [[0, 1], [0]] and two.grad_early == [1, 0]
    assert two.grad_bytes_sent == 3 * 256 * 128 * 2 * 4
    # A 200-token window over 2 contiguous shards of 1024: rank 0's shard goes on with the rows
    # rank 1 reads, [768, 1024), and rank 1 returns their dK / dV only (send_cost_bytes=0: rows
    # whenever fewer; at the default cost, 192 KiB left out do not pay for the extra sends).
    window = flexc.plan_ring(flexc.Variant.from_catalogue("sliding_window"), 2, 2048,
                             sharding="contiguous", params={"window": 200},
                             send_cost_bytes=0)
    assert window.steps[0].rows_sent == [(768, 1024), (0, 0)]
    assert window.steps[1].grad_rows == [(0, 0), (768, 1024)]
    assert "blocks computed 10 of 16" in str(contiguous)
    doc = flexc.Variant.from_catalogue("document")
    ids = np.repeat(np.arange(2, dtype=np.int32), 512)
    assert flexc.plan_ring(doc, 2, 1024, sharding="contiguous",
                           captures={"doc": ids}).skipped_blocks == 2
    with pytest.raises(flexc.Error, match="seq_len 1000 must be a multiple"):
        flexc.plan_ring(causal, 4, 1000)
    with pytest.raises(flexc.Error, match="sharding"):
        flexc.plan_ring(causal, 4, 1024, sharding="diagonal")


def test_ring_attention_refuses_a_null_communicator():
    causal = flexc.Variant.from_catalogue("causal")
    with pytest.raises(flexc.Error, match="comm is null"):
        flexc.RingAttention(causal, 0, 2, 1024, q_heads=4, kv_heads=2, head_dim=64)
    with pytest.raises(flexc.Error, match="seq_len 1000 must be a multiple"):
        flexc.RingAttention(causal, 0, 2, 1000)


def test_ring_shard():
    torch = pytest.importorskip("torch")
    from flexc.torch import ring_shard
    x = torch.arange(8).view(1, 1, 8, 1)
    assert ring_shard(x, 0, 2).flatten().tolist() == [0, 1, 6, 7]
    assert ring_shard(x, 1, 2).flatten().tolist() == [2, 3, 4, 5]
    assert ring_shard(x, 1, 2, "contiguous").flatten().tolist() == [4, 5, 6, 7]


def test_compile_ahead_of_time_without_a_gpu():
    alibi = flexc.Variant.from_catalogue("alibi")
    fwd = flexc.compile(alibi, "attention_fwd", arch="sm_90", head_dim=64)
    assert "flexc_attention_fwd" in fwd.ptx and len(fwd.cubin) > 1000
    assert "slope" in fwd.source  # the generated hooks read the capture
    dec = flexc.compile(alibi, "attention_decode", arch="sm_90", dtype="fp16")
    assert dec.key != fwd.key and "flexc_attention_decode" in dec.ptx
    names = [k.name for k in flexc.kernel_templates("sm_80")]
    assert "attention_fwd" in names and "attention_fwd_sm90" not in names


def direct_attention(q, k, v, scale, score_fn):
    """float64 attention written out with numpy; score_fn(s, b, h, i, j) -> score or -inf."""
    B, H, L, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = np.zeros((B, H, L, v.shape[3]))
    lse = np.full((B, H, L), -np.inf)
    i, j = np.meshgrid(np.arange(L), np.arange(S), indexing="ij")
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            s = score_fn(scale * q[b, h].astype(np.float64) @ k[b, hk].astype(np.float64).T,
                         b, h, i, j)
            mx = s.max(axis=1, keepdims=True)
            ok = np.isfinite(mx[:, 0])
            p = np.where(ok[:, None], np.exp(s - np.where(ok[:, None], mx, 0)), 0)
            den = p.sum(axis=1)
            out[b, h] = np.where(ok[:, None], (p @ v[b, hk]) / np.where(ok, den, 1)[:, None], 0)
            lse[b, h] = np.where(ok, mx[:, 0] + np.log(np.where(ok, den, 1)), -np.inf)
    return out, lse


def test_reference_matches_numpy():
    q = RNG.standard_normal((2, 4, 13, 32)).astype(np.float32)
    k = RNG.standard_normal((2, 2, 21, 32)).astype(np.float32)
    v = RNG.standard_normal((2, 2, 21, 16)).astype(np.float32)
    slopes = RNG.standard_normal(4).astype(np.float32)
    alibi = flexc.Variant.from_catalogue("alibi") & flexc.Variant.from_catalogue("causal")
    out, lse = flexc.reference_attention(alibi, q, k, v, captures={"slope": slopes}, scale=0.3)
    assert out.shape == (2, 4, 13, 16) and lse.shape == (2, 4, 13)
    want_out, want_lse = direct_attention(
        q, k, v, 0.3,
        lambda s, b, h, i, j: np.where(i >= j, s + np.float64(slopes[h]) * (j - i), -np.inf))
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    # A row with no key: output 0 and LSE -inf.
    none = flexc.Variant.from_strings("score", "q_idx != 0")
    out, lse = flexc.reference_attention(none, q, k, v)
    assert np.all(out[:, :, 0] == 0) and np.all(lse[:, :, 0] == -np.inf)
    assert np.isfinite(lse[:, :, 1:]).all()


def test_linear_attention_takes_cuda_tensors_only():
    x = np.zeros((1, 2, 8, 64), dtype=np.float16)
    state = np.zeros((1, 2, 64, 64), dtype=np.float32)
    with pytest.raises(flexc.Error, match="q is in cpu memory; flexc's kernels take CUDA"):
        flexc.linear_attention(x, x, x, x, g=np.zeros((1, 2, 8), dtype=np.float32))
    with pytest.raises(flexc.Error, match="q is in cpu memory"):
        flexc.linear_attention_step(x, x, x, state, x)


def raw(a, dtype):
    """flexc.torch's raw view of an array, (data_ptr, dtype, shape, strides in elements, CUDA
    device 0): the binding takes it as a CUDA tensor without reading it, so the C++ checks answer
    (they run before any GPU work; the memory is never read)."""
    return (a.ctypes.data, dtype, list(a.shape), [s // a.itemsize for s in a.strides], 0)


def test_linear_attention_backward_names_the_bad_argument():
    x = np.zeros((1, 2, 8, 64), dtype=np.float16)
    with pytest.raises(flexc.Error, match="q is in cpu memory; flexc's kernels take CUDA"):
        flexc.linear_attention_backward(x, x, x, x, x, x, x)
    arrays = [np.zeros((1, 2, 8, 64), dtype=np.float16) for _ in range(7)]  # distinct memory
    q, k, v, dout, dq, dk, dv = (raw(a, "fp16") for a in arrays)
    narrow = np.zeros((1, 2, 8, 32), dtype=np.float16)
    with pytest.raises(flexc.Error, match=r"dq must have the shape of q; got fp16 \[1, 2, 8, 32\]"):
        flexc.linear_attention_backward(q, k, v, dout, raw(narrow, "fp16"), dk, dv)
    gates = np.zeros((1, 2, 8), dtype=np.float32)
    with pytest.raises(flexc.Error, match="g is set, dg is not"):
        flexc.linear_attention_backward(q, k, v, dout, dq, dk, dv, g=raw(gates, "float32"))


def test_linear_variants_from_the_catalogue():
    assert flexc.LinearVariant.catalogue_names() == ["gla", "linear", "linear_elu", "retnet",
                                                     "simple_gla"]
    assert flexc.LinearVariant.load("@linear_elu").feature_map == "x > 0.0 ? x + 1.0 : exp(x)"
    assert flexc.LinearVariant.load("@gla").feature_map is None
    retnet = flexc.LinearVariant.load("@retnet")
    assert retnet.name == "retnet" and retnet.gate == "per_head" and retnet.scale is None
    assert "h" in retnet.log_decay and "RetNet" in retnet.description
    want = [np.float32(math.log(1 - 2 ** (-5 - h))) for h in range(3)]
    assert [np.float32(x) for x in retnet.head_log_decays(3)] == want
    gates = {n: flexc.LinearVariant.load("@" + n).gate for n in ("gla", "simple_gla", "linear")}
    assert gates == {"gla": "per_dim", "simple_gla": "per_step", "linear": "none"}
    assert flexc.LinearVariant.load("@gla").log_decay == ""
    with pytest.raises(flexc.Error, match="a per_dim gate has no per-head decay"):
        flexc.LinearVariant.load("@gla").head_log_decays(2)
    with pytest.raises(flexc.Error, match="unknown linear-attention catalogue entry @nope"):
        flexc.LinearVariant.load("@nope")


def test_linear_variant_json_configs_and_their_errors(tmp_path):
    config = {"name": "halved", "kind": "linear", "gate": "per_head",
              "log_decay": "-0.5 * (h + 1)", "scale": 0.25}
    path = tmp_path / "halved.json"
    path.write_text(json.dumps(config))
    v = flexc.LinearVariant.load(str(path))
    assert v.name == "halved" and v.gate == "per_head" and v.scale == 0.25
    assert v.head_log_decays(2) == [-0.5, -1.0]

    def error(**changes):
        with pytest.raises(flexc.Error) as e:
            flexc.LinearVariant.from_json(json.dumps({**config, **changes}), "mine.json")
        assert isinstance(e.value, ValueError)
        return str(e.value)

    message = error(gate="per_hed")
    assert message.startswith("mine.json: gate: ") and 'did you mean "per_head"' in message
    message = error(log_decay="-0.01 * kv_idx")
    assert "mine.json: log_decay: reads kv_idx" in message
    assert "an expression of h alone" in message
    # A positive decay is found where heads are known: by head_log_decays.
    growing = flexc.LinearVariant.from_json(json.dumps({**config, "log_decay": "0.5 - h"}))
    with pytest.raises(flexc.Error, match="log_decay is 0.5 at h = 0"):
        growing.head_log_decays(2)
