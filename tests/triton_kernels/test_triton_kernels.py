"""Property tests: Triton attention kernels vs the float64 torch reference.

Runs on the CPU under the Triton interpreter. TRITON_INTERPRET is read when a kernel is decorated,
so it must be set before ``triton_kernels`` is imported (importing ``triton`` first is harmless).
Pools are poisoned: every pool row a request does not own, the padding page and the rows of the
new (extend) tokens hold NaN, so reading anything but the right prefix rows shows up as NaN.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import triton_kernels as tk  # noqa: E402
from triton_kernels import reference as ref  # noqa: E402
from triton_kernels.backend import TritonAttention  # noqa: E402

TOLERANCE = {
    torch.float32: 2e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}  # relative to max |ref|
DTYPES = list(TOLERANCE)
slow = pytest.mark.skipif(os.environ.get("PDO_SLOW") != "1", reason="slow: set PDO_SLOW=1")


def build_case(
    seed,
    prefix_lens,
    extend_lens,
    page_size,
    h_kv,
    group,
    head_dim,
    dtype,
    index_dtype=torch.int32,
    fused_qkv=False,
):
    """A batch over a paged pool whose pages are shuffled; returns the kernels' keyword arguments."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(prefix_lens)
    contexts = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_req = [math.ceil(c / page_size) for c in contexts]
    num_pages = 1 + sum(pages_per_req) + 3  # page 0 reserved, a few spare pages never used
    num_tokens_pool = num_pages * page_size
    k_pool = torch.full((num_tokens_pool, h_kv, head_dim), float("nan"), dtype=dtype)
    v_pool = k_pool.clone()

    num_slots = batch + 2
    max_context = max(contexts) + 3
    req_to_token = torch.zeros(
        num_slots, max_context, dtype=index_dtype
    )  # unused entries -> padding page
    slots = torch.randperm(num_slots, generator=gen)[:batch]
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    for i, ctx in enumerate(contexts):
        mine = torch.tensor([pages.pop() for _ in range(pages_per_req[i])])
        tokens = (mine[:, None] * page_size + torch.arange(page_size)).flatten()[:ctx]
        req_to_token[slots[i], :ctx] = tokens.to(index_dtype)
        prefix = tokens[: prefix_lens[i]]
        k_pool[prefix] = torch.randn(len(prefix), h_kv, head_dim, generator=gen).to(dtype)
        v_pool[prefix] = torch.randn(len(prefix), h_kv, head_dim, generator=gen).to(dtype)

    total = sum(extend_lens)
    h_q = h_kv * group
    if fused_qkv:  # q/k/v as strided views into one projection output, as an engine produces them
        qkv = torch.randn(total, h_q + 2 * h_kv, head_dim, generator=gen).to(dtype)
        q, k, v = qkv[:, :h_q], qkv[:, h_q : h_q + h_kv], qkv[:, h_q + h_kv :]
    else:
        q = torch.randn(total, h_q, head_dim, generator=gen).to(dtype)
        k = torch.randn(total, h_kv, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, h_kv, head_dim, generator=gen).to(dtype)
    starts = [sum(extend_lens[:i]) for i in range(batch)]
    as_index = lambda values: torch.tensor(values, dtype=index_dtype)  # noqa: E731
    return dict(
        q=q,
        k=k,
        v=v,
        k_pool=k_pool,
        v_pool=v_pool,
        req_to_token=req_to_token,
        req_slots=slots.to(index_dtype),
        prefix_lens=as_index(prefix_lens),
        extend_lens=as_index(extend_lens),
        extend_start_loc=as_index(starts),
        max_extend_len=max(extend_lens),
    )


def fill_extend_rows(case):
    """Write the extend tokens into the pool (as the engine does before decode), via the reference."""
    locs = torch.cat(
        [
            case["req_to_token"][s, p : p + e].long()
            for s, p, e in zip(
                case["req_slots"].tolist(),
                case["prefix_lens"].tolist(),
                case["extend_lens"].tolist(),
            )
        ]
    )
    ref.write_kv(case["k_pool"], case["v_pool"], locs, case["k"], case["v"])
    return locs


def assert_close(out, expected, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), (
        "output has NaN/inf: an element was not written or poison was read"
    )
    scale = expected.abs().max().clamp_min(1e-6)
    err = ((out.double() - expected).abs().max() / scale).item()
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]} for {dtype}"


def check_extend(case):
    dtype = case["q"].dtype
    out = torch.full(case["q"].shape, float("nan"), dtype=dtype)
    result = tk.extend_attention(**case, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, ref.extend_attention(**case, out_dtype=torch.float64), dtype)


def check_decode(case, num_kv_splits):
    fill_extend_rows(case)
    seq_lens = case["prefix_lens"] + case["extend_lens"]
    batch, h_q, head_dim = len(seq_lens), case["q"].shape[1], case["q"].shape[2]
    q = torch.randn(batch, h_q, head_dim, generator=torch.Generator().manual_seed(1)).to(
        case["q"].dtype
    )
    args = (q, case["k_pool"], case["v_pool"], case["req_to_token"], case["req_slots"], seq_lens)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    tk.decode_attention(*args, num_kv_splits=num_kv_splits, out=out)
    assert_close(out, ref.decode_attention(*args, out_dtype=torch.float64), q.dtype)


@st.composite
def cases(draw, max_batch=4, max_extend=40, max_prefix=50):
    batch = draw(st.integers(1, max_batch))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        prefix_lens=draw(st.lists(st.integers(0, max_prefix), min_size=batch, max_size=batch)),
        extend_lens=draw(st.lists(st.integers(1, max_extend), min_size=batch, max_size=batch)),
        page_size=draw(st.sampled_from([1, 4, 16])),
        h_kv=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([16, 64, 96])),
        dtype=draw(st.sampled_from(DTYPES)),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        fused_qkv=draw(st.booleans()),
    )


FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(FAST, max_examples=50)
@given(params=cases())
def test_extend_matches_reference(params):
    check_extend(build_case(**params))


@settings(FAST, max_examples=40)
@given(params=cases(max_extend=8), num_kv_splits=st.sampled_from([None, 1, 2, 3, 7]))
def test_decode_matches_reference(params, num_kv_splits):
    check_decode(build_case(**params), num_kv_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_head_dim_128_gqa(dtype):
    check_extend(build_case(7, [37, 0], [33, 17], 16, 2, 4, 128, dtype))


@pytest.mark.parametrize(
    "prefix_lens, extend_lens",
    [([0], [1]), ([5], [1]), ([0, 50, 3], [40, 1, 2]), ([16, 32], [16, 32]), ([0, 0], [33, 32])],
    ids=["single-token", "one-token-with-prefix", "ragged", "tile-aligned", "dense-no-prefix"],
)
def test_extend_edge_shapes(prefix_lens, extend_lens):
    check_extend(build_case(3, prefix_lens, extend_lens, 4, 1, 2, 96, torch.float32))


@pytest.mark.parametrize("num_kv_splits", [1, 2, 5, 17])
def test_decode_split_counts(num_kv_splits):
    # 17 splits leave most splits empty for these lengths: they must merge with zero weight.
    check_decode(build_case(11, [70, 3, 20], [1, 1, 9], 4, 2, 2, 64, torch.float16), num_kv_splits)


def test_large_logits_stay_finite():
    # Scores of several hundred in the exp2 domain overflow fp32 unless every exponent is max-shifted.
    case = build_case(13, [40, 9], [20, 1], 4, 1, 2, 64, torch.float32)
    case["q"] = case["q"] * 200.0
    check_extend(case)
    fill_extend_rows(case)
    seq_lens = case["prefix_lens"] + case["extend_lens"]
    q = case["q"][:2]
    args = (q, case["k_pool"], case["v_pool"], case["req_to_token"], case["req_slots"], seq_lens)
    for splits in (1, 3):
        expected = ref.decode_attention(*args, out_dtype=torch.float64)
        assert_close(tk.decode_attention(*args, num_kv_splits=splits), expected, torch.float32)


def test_garbage_beyond_context_is_never_read():
    case = build_case(5, [10, 4], [6, 3], 4, 1, 1, 16, torch.float32)
    for slot, prefix in zip(case["req_slots"].tolist(), case["prefix_lens"].tolist()):
        case["req_to_token"][slot, prefix:] = 10**6  # extend reads packed k/v, never these entries
    check_extend(case)


@pytest.mark.parametrize("bad_index", [-1, 10**6])
def test_invalid_token_index_raises(bad_index):
    case = build_case(5, [10, 4], [6, 3], 4, 1, 1, 16, torch.float32)
    slot = int(case["req_slots"][0])
    case["req_to_token"][slot, 3] = bad_index
    with pytest.raises(ValueError, match="outside the KV pool"):
        tk.extend_attention(**case)
    seq_lens = case["prefix_lens"] + case["extend_lens"]
    q = torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="outside the KV pool"):
        tk.decode_attention(
            q, case["k_pool"], case["v_pool"], case["req_to_token"], case["req_slots"], seq_lens
        )


def test_invalid_metadata_raises():
    case = build_case(5, [10, 4], [6, 3], 4, 1, 1, 16, torch.float32)
    bad_slot = dict(case, req_slots=torch.tensor([0, 99], dtype=torch.int32))
    with pytest.raises(ValueError, match="req_slots"):
        tk.extend_attention(**bad_slot)
    with pytest.raises(ValueError, match="max_extend_len"):
        tk.extend_attention(**dict(case, max_extend_len=2))
    with pytest.raises(ValueError, match="exceed"):
        tk.extend_attention(**dict(case, extend_start_loc=torch.tensor([0, 8], dtype=torch.int32)))
    with pytest.raises(ValueError, match="query heads"):
        tk.extend_attention(
            **dict(
                case,
                q=torch.randn(9, 3, 16),
                k=torch.randn(9, 2, 16),
                v=torch.randn(9, 2, 16),
                k_pool=case["k_pool"].expand(-1, 2, -1),
                v_pool=case["v_pool"].expand(-1, 2, -1),
            )
        )
    with pytest.raises(ValueError, match="seq_lens"):
        tk.decode_attention(
            torch.randn(2, 1, 16),
            case["k_pool"],
            case["v_pool"],
            case["req_to_token"],
            case["req_slots"],
            torch.tensor([0, 3]),
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_kv(dtype, index_dtype):
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(40, 2, 96, generator=gen).to(dtype)
    v_pool = torch.randn(40, 2, 96, generator=gen).to(dtype)
    loc = torch.randperm(40, generator=gen)[:7].to(index_dtype)
    k = torch.randn(7, 2, 96, generator=gen).to(dtype)
    v = torch.randn(7, 2, 96, generator=gen).to(dtype)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    ref.write_kv(expected_k, expected_v, loc, k, v)
    tk.write_kv(k_pool, v_pool, loc, k, v)
    assert torch.equal(k_pool, expected_k) and torch.equal(
        v_pool, expected_v
    )  # bit-exact, untouched rows too
    with pytest.raises(ValueError, match="outside the pool"):
        tk.write_kv(k_pool, v_pool, torch.tensor([3, 40] + [0] * 5, dtype=index_dtype), k, v)


def test_backend_adapter_end_to_end():
    """write_kv + extend, then decode of the next token, through the engine-facing adapter."""
    case = build_case(21, [12, 0], [5, 9], 4, 2, 2, 64, torch.bfloat16)
    backend = TritonAttention()
    assert backend.name == "triton"
    locs = torch.cat(
        [
            case["req_to_token"][s, p : p + e]
            for s, p, e in zip(
                case["req_slots"].tolist(),
                case["prefix_lens"].tolist(),
                case["extend_lens"].tolist(),
            )
        ]
    )
    flat = lambda t: t.reshape(t.shape[0], -1)  # noqa: E731 - the engine may pass [T, H * D]
    backend.write_kv(case["k_pool"], case["v_pool"], locs, flat(case["k"]), flat(case["v"]))
    meta = SimpleNamespace(
        **{
            key: case[key]
            for key in (
                "req_to_token",
                "req_slots",
                "prefix_lens",
                "extend_lens",
                "extend_start_loc",
                "max_extend_len",
            )
        },
        out_cache_loc=locs,
    )
    out = backend.extend(
        flat(case["q"]), flat(case["k"]), flat(case["v"]), case["k_pool"], case["v_pool"], meta
    )
    assert out.shape == flat(case["q"]).shape
    assert_close(
        out.view(case["q"].shape),
        ref.extend_attention(**case, out_dtype=torch.float64),
        torch.bfloat16,
    )

    seq_lens = case["prefix_lens"] + case["extend_lens"]
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    decode_meta = SimpleNamespace(
        req_to_token=case["req_to_token"],
        req_slots=case["req_slots"],
        seq_lens=seq_lens,
        out_cache_loc=locs[:2],
    )
    out = backend.decode(q, case["k_pool"], case["v_pool"], decode_meta)
    expected = ref.decode_attention(
        q,
        case["k_pool"],
        case["v_pool"],
        case["req_to_token"],
        case["req_slots"],
        seq_lens,
        out_dtype=torch.float64,
    )
    assert_close(out, expected, torch.bfloat16)


def test_interpreting_on_cpu():
    assert tk.interpreting()


def test_bench_smoke(tmp_path):
    from triton_kernels.bench import main

    path = tmp_path / "bench.json"
    main(["--smoke", "--json-out", str(path)])
    result = json.loads(path.read_text())
    cases = {row["case"] for row in result["rows"]}
    assert {"extend_dense", "extend_paged", "decode", "write_kv"} <= cases
    assert all(row["ms"] > 0 for row in result["rows"])


@slow
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_and_decode_larger(dtype):
    case = build_case(99, [300, 0, 129], [200, 257, 1], 16, 2, 4, 128, dtype)
    check_extend(case)
    check_decode(case, None)
