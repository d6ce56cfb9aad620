"""Benchmark the Triton kernels against torch SDPA (and flashinfer / flash_attn when importable).

    python -m triton_kernels.bench [--smoke] [--json] [--json-out FILE]

Cases (bf16, head_dim 128, 32 query / 8 KV heads):
  extend_dense  causal prefill without prefix, seq 1k..16k, batch sized to ~16k tokens per launch
  extend_paged  the same total contexts with 80% of each as a cached prefix in shuffled pages of 16
  decode        one query per request over 1k..64k contexts, pages of 16 and 64
  write_kv      the Triton scatter vs two index_copy_ calls
On CUDA: CUDA-event timing, median of the timed iterations after warm-up (which also autotunes).
Prefill reports TFLOP/s over the visible (causal) query-key pairs only: 4 * D * pairs * H_q. Decode
reports GB/s of K/V bytes read and its share of the HBM bandwidth measured with a device-to-device copy.
--smoke runs tiny shapes on the CPU under the Triton interpreter (for CI); its numbers mean nothing
beyond "everything ran".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import bias as attention_bias

from triton_kernels import decode_attention, extend_attention, interpreting, write_kv
from triton_kernels.decode_attention import choose_num_kv_splits


def _timer(device: torch.device, warmup: int, iters: int):
    def measure(fn) -> float:
        """Median milliseconds of fn()."""
        for _ in range(warmup):
            fn()
        if device.type != "cuda":
            samples = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
            return statistics.median(samples)
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events)

    return measure


def _paged_table(batch: int, context: int, page_size: int, device) -> tuple[torch.Tensor, int]:
    """req_to_token [batch, context] over shuffled pages (page 0 reserved); returns it and the pool size."""
    pages_per_req = math.ceil(context / page_size)
    num_pages = batch * pages_per_req + 1
    pages = (torch.randperm(num_pages - 1, device=device) + 1).view(batch, pages_per_req)
    tokens = pages[:, :, None] * page_size + torch.arange(page_size, device=device)
    return tokens.view(batch, -1)[:, :context].to(torch.int32).contiguous(), num_pages * page_size


def _try(fn):
    """Build an optional baseline; a missing package or an API mismatch just drops the column."""
    try:
        run = fn()
        run()
        return run
    except Exception:  # noqa: BLE001 - any failure of an optional third-party baseline is non-fatal
        return None


def _sdpa(q, k, v, causal_lower_right: bool):
    """q [B, H_q, M, D], k/v [B, H_kv, N, D]; queries are the last M of N positions when causal."""
    if causal_lower_right:
        mask = attention_bias.causal_lower_right(q.shape[2], k.shape[2])
        kwargs = dict(attn_mask=mask)
    else:
        kwargs = dict(is_causal=q.shape[2] > 1)
    if k.shape[1] != q.shape[1]:
        try:  # native GQA (torch >= 2.5) reads each KV head once, as the Triton kernels do
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
            return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        except (TypeError, RuntimeError):
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


def _flashinfer_workspace(device):
    return torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)


def bench_extend(
    measure,
    device,
    dtype,
    seq: int,
    tokens: int,
    prefix_frac: float,
    page_size: int,
    heads: tuple[int, int],
    head_dim: int,
) -> dict:
    batch = max(1, tokens // seq)
    h_q, h_kv = heads
    prefix = int(seq * prefix_frac)
    ext = seq - prefix
    req_to_token, pool_tokens = _paged_table(batch, seq, page_size, device)
    k_pool = torch.randn(pool_tokens, h_kv, head_dim, device=device, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(batch * ext, h_q, head_dim, device=device, dtype=dtype)
    # The engine writes the new tokens' K/V to the pool before attention; take them from there.
    ext_tokens = req_to_token[:, prefix:].reshape(-1).long()
    k, v = k_pool[ext_tokens], v_pool[ext_tokens]
    as_meta = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    slots = as_meta(list(range(batch)))
    prefix_lens, ext_lens = as_meta([prefix] * batch), as_meta([ext] * batch)
    starts = as_meta([i * ext for i in range(batch)])

    def triton_run():
        return extend_attention(
            q, k, v, k_pool, v_pool, req_to_token, slots, prefix_lens, ext_lens, starts, ext
        )

    pairs = batch * (ext * prefix + ext * (ext + 1) // 2)
    flops = 4 * head_dim * pairs * h_q
    row = dict(
        case="extend_paged" if prefix else "extend_dense",
        seq=seq,
        batch=batch,
        prefix=prefix,
        extend=ext,
        page_size=page_size,
        heads=f"{h_q}/{h_kv}",
        head_dim=head_dim,
        dtype=str(dtype).split(".")[-1],
    )
    row["ms"] = measure(triton_run)
    row["tflops"] = flops / row["ms"] / 1e9

    # Baselines see contiguous K/V for the whole context.
    keys = k_pool[req_to_token.view(-1).long()].view(batch, seq, h_kv, head_dim)
    values = v_pool[req_to_token.view(-1).long()].view(batch, seq, h_kv, head_dim)
    q4 = q.view(batch, ext, h_q, head_dim).transpose(1, 2)
    sdpa = _try(
        lambda: _sdpa(
            q4, keys.transpose(1, 2), values.transpose(1, 2), causal_lower_right=prefix > 0
        )
    )
    if sdpa is not None:
        row["sdpa_ms"] = measure(sdpa)
        ours = triton_run().view(batch, ext, h_q, head_dim).float()
        row["max_abs_err_vs_sdpa"] = (ours - sdpa().transpose(1, 2).float()).abs().max().item()

    def flash_attn_run():
        from flash_attn import flash_attn_varlen_func  # lazy: an optional baseline

        cu_q = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * ext
        cu_k = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * seq
        kk, vv = keys.reshape(-1, h_kv, head_dim), values.reshape(-1, h_kv, head_dim)
        return lambda: flash_attn_varlen_func(q, kk, vv, cu_q, cu_k, ext, seq, causal=True)

    def flashinfer_run():
        import flashinfer  # lazy: an optional baseline

        pages = req_to_token[:, ::page_size].div(page_size, rounding_mode="floor").reshape(-1)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            _flashinfer_workspace(device), "NHD"
        )
        wrapper.plan(
            as_meta([i * ext for i in range(batch + 1)]),
            as_meta([i * math.ceil(seq / page_size) for i in range(batch + 1)]),
            pages.int(),
            as_meta([seq - (math.ceil(seq / page_size) - 1) * page_size] * batch),
            h_q,
            h_kv,
            head_dim,
            page_size,
            causal=True,
            q_data_type=dtype,
        )
        cache = (
            k_pool.view(-1, page_size, h_kv, head_dim),
            v_pool.view(-1, page_size, h_kv, head_dim),
        )
        return lambda: wrapper.run(q, cache)

    for label, build in (("flash_attn", flash_attn_run), ("flashinfer", flashinfer_run)):
        run = _try(build) if device.type == "cuda" else None
        if run is not None:
            row[f"{label}_ms"] = measure(run)
    return row


def bench_decode(
    measure,
    device,
    dtype,
    context: int,
    batch: int,
    page_size: int,
    heads: tuple[int, int],
    head_dim: int,
) -> dict:
    h_q, h_kv = heads
    req_to_token, pool_tokens = _paged_table(batch, context, page_size, device)
    k_pool = torch.randn(pool_tokens, h_kv, head_dim, device=device, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(batch, h_q, head_dim, device=device, dtype=dtype)
    slots = torch.arange(batch, device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    splits = choose_num_kv_splits(
        batch, h_kv, context, device
    )  # once per step, as the backend does

    def triton_run():
        return decode_attention(
            q, k_pool, v_pool, req_to_token, slots, seq_lens, num_kv_splits=splits
        )

    kv_bytes = 2 * batch * context * h_kv * head_dim * k_pool.element_size()
    row = dict(
        case="decode",
        seq=context,
        batch=batch,
        page_size=page_size,
        heads=f"{h_q}/{h_kv}",
        head_dim=head_dim,
        dtype=str(dtype).split(".")[-1],
        num_kv_splits=splits,
    )
    row["ms"] = measure(triton_run)
    row["gbps"] = kv_bytes / row["ms"] / 1e6

    # Baselines read a contiguous cache of the same size (SDPA has no paged mode).
    index = req_to_token.view(-1).long()
    keys = k_pool[index].view(batch, context, h_kv, head_dim)
    values = v_pool[index].view(batch, context, h_kv, head_dim)
    sdpa = _try(
        lambda: _sdpa(
            q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), causal_lower_right=False
        )
    )
    if sdpa is not None:
        row["sdpa_ms"] = measure(sdpa)
        row["sdpa_gbps"] = kv_bytes / row["sdpa_ms"] / 1e6

    def flash_attn_run():
        from flash_attn import flash_attn_with_kvcache  # lazy: an optional baseline

        return lambda: flash_attn_with_kvcache(q[:, None], keys, values, cache_seqlens=seq_lens)

    if device.type == "cuda":
        run = _try(flash_attn_run)
        if run is not None:
            row["flash_attn_ms"] = measure(run)
    return row


def bench_decode_flashinfer(measure, device, dtype, row: dict) -> None:
    """flashinfer decodes straight from a paged pool; timed separately so the pools can be rebuilt."""
    if device.type != "cuda":
        return
    batch, context, page_size = row["batch"], row["seq"], row["page_size"]
    h_q, h_kv = map(int, row["heads"].split("/"))
    head_dim = row["head_dim"]

    def build():
        import flashinfer  # lazy: an optional baseline

        req_to_token, pool_tokens = _paged_table(batch, context, page_size, device)
        k_pool = torch.randn(pool_tokens, h_kv, head_dim, device=device, dtype=dtype)
        v_pool = torch.randn_like(k_pool)
        q = torch.randn(batch, h_q, head_dim, device=device, dtype=dtype)
        pages_per_req = math.ceil(context / page_size)
        pages = req_to_token[:, ::page_size].div(page_size, rounding_mode="floor").reshape(-1).int()
        meta = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _flashinfer_workspace(device), "NHD"
        )
        wrapper.plan(
            meta([i * pages_per_req for i in range(batch + 1)]),
            pages,
            meta([context - (pages_per_req - 1) * page_size] * batch),
            h_q,
            h_kv,
            head_dim,
            page_size,
            data_type=dtype,
        )
        cache = (
            k_pool.view(-1, page_size, h_kv, head_dim),
            v_pool.view(-1, page_size, h_kv, head_dim),
        )
        return lambda: wrapper.run(q, cache)

    run = _try(build)
    if run is not None:
        row["flashinfer_ms"] = measure(run)


def bench_write_kv(measure, device, dtype, tokens: int, heads: int, head_dim: int) -> dict:
    pool = 4 * tokens + 16
    k_pool = torch.zeros(pool, heads, head_dim, device=device, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    loc = (torch.randperm(pool - 16, device=device)[:tokens] + 16).to(torch.int32)
    k = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)

    def index_copy():
        index = loc.long()
        k_pool.index_copy_(0, index, k)
        v_pool.index_copy_(0, index, v)

    row = dict(
        case="write_kv",
        tokens=tokens,
        heads=heads,
        head_dim=head_dim,
        dtype=str(dtype).split(".")[-1],
    )
    row["ms"] = measure(lambda: write_kv(k_pool, v_pool, loc, k, v))
    row["index_copy_ms"] = measure(index_copy)
    row["gbps"] = 2 * 2 * k.numel() * k.element_size() / row["ms"] / 1e6  # read + write, K and V
    return row


def hbm_bandwidth_gbps(measure, device) -> float:
    """Device-to-device copy of 2 GiB (read + write counted)."""
    numel = (2 << 30) // 4 if device.type == "cuda" else 1 << 20
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def _add_ratios(rows: list[dict], hbm_gbps: float) -> None:
    dense = {r["seq"]: r["tflops"] for r in rows if r["case"] == "extend_dense"}
    for r in rows:
        baselines = [r[key] for key in ("sdpa_ms", "flash_attn_ms", "flashinfer_ms") if key in r]
        if baselines:
            r["speedup_vs_best_baseline"] = min(baselines) / r["ms"]
        if "sdpa_ms" in r:
            r["speedup_vs_sdpa"] = r["sdpa_ms"] / r["ms"]
        if r["case"] == "extend_paged" and r["seq"] in dense:
            r["vs_dense"] = r["tflops"] / dense[r["seq"]]
        if r["case"] == "decode":
            r["hbm_pct"] = 100 * r["gbps"] / hbm_gbps


def run(smoke: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not smoke and device.type != "cuda":
        print("no CUDA device: running the --smoke shapes instead")
        smoke = True
    measure = _timer(device, warmup=0 if smoke else 5, iters=1 if smoke else 20)
    dtype = torch.bfloat16
    if smoke:
        heads, head_dim, seqs, tokens = (4, 2), 32, [32, 48], 64
        decode_shapes = [(64, 2, 16), (96, 1, 4)]
        write_shapes = [8]
    else:
        heads, head_dim, seqs, tokens = (32, 8), 128, [1024, 2048, 4096, 8192, 16384], 16384
        # batch so that each decode case reads ~4 GiB of K/V (capped at 256 requests)
        per_req = lambda ctx: 2 * ctx * heads[1] * head_dim * 2  # noqa: E731
        decode_shapes = [
            (ctx, min(256, max(1, (4 << 30) // per_req(ctx))), page)
            for page in (16, 64)
            for ctx in (1024, 4096, 16384, 65536)
        ]
        write_shapes = [64, 4096]

    rows = []
    for seq in seqs:
        rows.append(bench_extend(measure, device, dtype, seq, tokens, 0.0, 16, heads, head_dim))
        rows.append(bench_extend(measure, device, dtype, seq, tokens, 0.8, 16, heads, head_dim))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for context, batch, page in decode_shapes:
        row = bench_decode(measure, device, dtype, context, batch, page, heads, head_dim)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        bench_decode_flashinfer(measure, device, dtype, row)
        rows.append(row)
    for tokens_written in write_shapes:
        rows.append(bench_write_kv(measure, device, dtype, tokens_written, heads[1], head_dim))
    hbm = hbm_bandwidth_gbps(measure, device)
    _add_ratios(rows, hbm)
    return dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        interpreted=interpreting(),
        smoke=smoke,
        torch=torch.__version__,
        hbm_gbps=hbm,
        rows=rows,
    )


def _print_table(result: dict) -> None:
    columns = [
        "case",
        "seq",
        "batch",
        "page_size",
        "ms",
        "tflops",
        "gbps",
        "hbm_pct",
        "vs_dense",
        "sdpa_ms",
        "flash_attn_ms",
        "flashinfer_ms",
        "index_copy_ms",
        "speedup_vs_sdpa",
        "speedup_vs_best_baseline",
    ]
    present = [c for c in columns if any(c in r for r in result["rows"])]
    fmt = lambda x: f"{x:.4g}" if isinstance(x, float) else str(x)  # noqa: E731
    table = [present] + [[fmt(r.get(c, "")) for c in present] for r in result["rows"]]
    widths = [max(len(line[i]) for line in table) for i in range(len(present))]
    print(
        f"device: {result['device']}  interpreted: {result['interpreted']}  HBM copy: {result['hbm_gbps']:.0f} GB/s"
    )
    for line in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, CPU/interpreter friendly"
    )
    # pdo's convention: --json prints on stdout (no table), --json-out writes a file
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--json-out", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    result = run(args.smoke)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
