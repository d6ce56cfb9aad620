"""Ahead-of-time compile of every Triton kernel the attention backend launches, for sm_90 (H200).

No GPU needed: Triton's own compiler (MLIR -> LLVM -> PTX) and the ptxas shipped in the wheel
(triton/backends/nvidia/bin) build the cubins for ``GPUTarget("cuda", 90, 32)``. A compile error
here is one that would otherwise surface only on the GPU.

What is compiled is exactly what the wrappers would launch: the backend (``TritonAttention``, with
the engine's tensor shapes, dtypes and int32 metadata) is called on CPU tensors with the launch
objects replaced by recorders, so every constexpr (GROUP, HEAD_DIM, BLOCK_D, BLOCK_H, BLOCK_S, UPCAST,
DOT_PRECISION), the ``len_bucket`` argument and all strides come from the wrappers' own code; each
recorded launch is then compiled through the kernel's own ``warmup`` (the JIT's binder decides the
specialisations: ints equal to 1 become constants, pointers and ints divisible by 16 get the
divisibility hint) with a stand-in driver that reports an sm_90 target. Tuned kernels are compiled
once per config of their ``_cuda_configs()``. ``num_kv_splits`` takes every value that
``choose_num_kv_splits`` can return on an H200 (132 SMs) for the preset; identical specialisations
are compiled once.

Matrix (the full one is ~2.5 CPU-minutes; this one ~60 CPU-seconds, most of it large/bf16, run as two
subprocesses - the extend kernel, the rest - so ~40 s on an idle 2-core machine):
  * large preset (head_dim 128, 16 q heads, 4 kv heads), bf16: all 6 extend configs (short-length
    bucket; the long bucket, whose code differs only by the unused ``len_bucket`` becoming a
    constant, with config 0), decode split x all 5 configs for every distinct specialisation of the
    64 reachable split counts, the reduce kernel likewise, write_kv.
  * tiny preset (head_dim 16, 4 q heads, 2 kv heads), bf16 and fp32: a representative subset - extend
    (short-length bucket, the one the default chunk size gives) with the two extreme configs
    (128x64, 8 warps, 3 stages; 64x32, 4 warps, 3 stages), decode split with two configs (BLOCK_N 64
    and 32) for num_kv_splits 1 and 4, the reduce kernel for all reachable split counts, write_kv.
    fp32 takes the UPCAST / ``input_precision="ieee"`` path, which large/bf16 does not.

Besides a non-empty PTX and cubin per compile, each (kernel, shape) must have at least one config
within the H200's 227 KiB of shared memory per block (larger ones would be dropped by the autotuner).

The compiles run in subprocesses with TRITON_INTERPRET=0: tests/conftest.py turns the interpreter
on before Triton is imported, and then ``@triton.jit`` builds interpreter objects that cannot be
compiled. They use a fresh Triton cache (under tmp_path), so every run really compiles. The test skips
only when the toolchain is missing (no NVIDIA backend or no runnable ptxas).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCH = 90
H200_SMS = 132
H200_MAX_SHARED = 232448  # bytes per block (opt-in), sm_90
TIMEOUT_S = 600

# (preset, dtype, full matrix?)
CASES = [("large", "bfloat16", True), ("tiny", "bfloat16", False), ("tiny", "float32", False)]
# Subset for the non-full cases: indices into the kernels' _cuda_configs() lists, and split counts.
SUBSET_EXTEND_CONFIGS = (0, 5)
SUBSET_DECODE_CONFIGS = (0, 1)
SUBSET_SPLITS = (1, 4)
# len_bucket only keys the autotuner (the kernel never reads it), but as an int equal to 1 the JIT makes
# it a constant, so the long bucket is a separate compile of otherwise identical code: one config of it.
BUCKET1_CONFIGS = (0,)


# --------------------------------------------------------------------------------------- worker side


class _FakeDriver:
    """Just enough of a Triton driver for ``warmup`` to compile (never launch) for sm_90."""

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


class _Recorder:
    """Stands in for a kernel (or autotuned kernel) object: records launches instead of running them."""

    def __init__(self, kernel, launches, name):
        self.kernel, self.launches, self.name = kernel, launches, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, self.kernel, grid, args, kwargs))

        return launch


def _reachable_splits(kv_heads, max_context):
    """Every num_kv_splits choose_num_kv_splits returns on an H200 for this preset."""
    import torch

    da = sys.modules["triton_kernels.decode_attention"]
    dev = torch.device("cuda")
    da._sm_count[dev] = H200_SMS  # what torch.cuda.get_device_properties would report there
    lens = sorted(
        {1, max_context, *range(1, max_context + 1, 64), *range(256, max_context + 1, 256)}
    )
    return sorted(
        {da.choose_num_kv_splits(b, kv_heads, n, dev) for b in range(1, 257) for n in lens}
    )


def _record_launches(preset, dtype_name, full):
    """Drive the backend as the engine does on a GPU; return the launches the wrappers make."""
    import torch

    import triton_kernels  # noqa: F401  (registers the submodules)
    from engine.runtime.config import MODEL_PRESETS

    ea = sys.modules["triton_kernels.extend_attention"]
    da = sys.modules["triton_kernels.decode_attention"]
    kw = sys.modules["triton_kernels.kv_write"]
    assert ea._extend_kernel_tuned is not None, "kernels were built for the interpreter"

    mc = MODEL_PRESETS[preset]
    dtype = getattr(torch, dtype_name)
    launches = []
    patches = [
        (mod, "_can_launch", lambda kernel, device: True) for mod in (ea, da, kw)
    ]  # CPU for CUDA
    patches += [
        (ea, "_extend_kernel_tuned", "extend"),
        (da, "_decode_split_kernel_tuned", "decode_split"),
        (da, "_decode_reduce_kernel", "decode_reduce"),
        (kw, "_write_kv_kernel", "write_kv"),
    ]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patches]
    for mod, attr, new in patches:
        setattr(
            mod, attr, _Recorder(getattr(mod, attr), launches, new) if isinstance(new, str) else new
        )
    try:
        return _drive_backend(mc, dtype, full, launches)
    finally:
        for mod, attr, old in saved:
            setattr(mod, attr, old)


def _drive_backend(mc, dtype, full, launches):
    import torch

    from engine.runtime.attention import DecodeMeta, ExtendMeta
    from engine.runtime.memory import KVPool, ReqToTokenPool
    from triton_kernels.backend import TritonAttention

    pool = KVPool(
        num_pages=8,
        page_size=16,
        layers=2,
        kv_heads=mc.kv_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
        device="cpu",
    )
    table = ReqToTokenPool(4, mc.max_context, "cpu").table
    table[0, :64] = torch.arange(16, 80, dtype=torch.int32)
    i32 = lambda *xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    li = 1  # a layer past the first: pool views with a storage offset, as in the engine

    def qkv(t):  # the model's layout: [t, heads, head_dim] out of a matmul and RoPE (contiguous)
        return (
            torch.zeros(t, mc.heads, mc.head_dim, dtype=dtype),
            torch.zeros(t, mc.kv_heads, mc.head_dim, dtype=dtype),
            torch.zeros(t, mc.kv_heads, mc.head_dim, dtype=dtype),
        )

    # Extend: max_extend_len picks the length bucket (<= 256: 0, else 1).
    backend = TritonAttention()
    for max_extend in (8, 300) if full else (8,):
        t = 8
        q, k, v = qkv(t)
        loc = i32(*range(16, 16 + t))
        meta = ExtendMeta(
            req_to_token=table,
            req_slots=i32(0),
            prefix_lens=i32(4),
            extend_lens=i32(t),
            extend_start_loc=i32(0),
            max_extend_len=max_extend,
            out_cache_loc=loc,
        )
        backend.write_kv(pool.k[li], pool.v[li], loc, k, v)
        backend.extend(q, k, v, pool.k[li], pool.v[li], meta)

    # Decode: one launch pair per reachable split count.
    splits = _reachable_splits(mc.kv_heads, mc.max_context)
    for s in splits if full else [x for x in splits if x in SUBSET_SPLITS] or splits[:1]:
        q, k, v = qkv(2)
        loc = i32(30, 31)
        meta = DecodeMeta(
            req_to_token=table,
            req_slots=i32(0, 1),
            seq_lens=i32(20, 9),
            out_cache_loc=loc,
            host_seq_lens=[20, 9],
        )
        backend.write_kv(pool.k[li], pool.v[li], loc, k, v)
        TritonAttention(num_kv_splits=s).decode(q, pool.k[li], pool.v[li], meta)
    if not full:  # the cheap reduce kernel: every reachable split count even in the subset
        for s in splits:
            if s not in SUBSET_SPLITS:
                q, _, _ = qkv(2)
                meta = DecodeMeta(
                    req_to_token=table,
                    req_slots=i32(0, 1),
                    seq_lens=i32(20, 9),
                    out_cache_loc=i32(30, 31),
                    host_seq_lens=[20, 9],
                )
                n = len(launches)
                TritonAttention(num_kv_splits=s).decode(q, pool.k[li], pool.v[li], meta)
                launches[n:] = [x for x in launches[n:] if x[0] == "decode_reduce"]
    return launches, splits


def _constexprs(kernel, kwargs):
    names = [p.name for p in kernel.params if p.is_constexpr]
    return {
        k: (v if isinstance(v, (int, float, bool, str, type(None))) else str(v))
        for k, v in kwargs.items()
        if k in names
    }


def _in_shard(shard, name):
    """Two shards of similar cost, one per core: the extend kernel, and the rest."""
    return shard == "all" or (shard == "0") == (name == "extend")


def _worker(out_path, shard="all"):
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, REPO)
    result = {"compiles": [], "errors": [], "skip": None}

    def dump():
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    # Toolchain check: only its absence may skip the test.
    try:
        from triton.backends import backends
        from triton.compiler.compiler import make_backend

        if "nvidia" not in backends:
            raise RuntimeError("Triton has no NVIDIA backend")
        from triton.backends.nvidia.compiler import get_ptxas

        make_backend(_FakeDriver(ARCH).target)
        ptxas = get_ptxas(ARCH).path
        version = subprocess.run(
            [ptxas, "--version"], capture_output=True, text=True, timeout=60, check=True
        )
        result["ptxas"] = version.stdout.strip().splitlines()[-1]
    except Exception as e:  # noqa: BLE001
        result["skip"] = f"no sm_{ARCH} toolchain: {type(e).__name__}: {e}"
        dump()
        return

    import traceback

    import triton
    from triton.runtime.driver import driver

    result["triton"] = triton.__version__
    driver.set_active(_FakeDriver(ARCH))
    seen = {}  # id(CompiledKernel) -> index in result["compiles"]
    cfg_lists = {}
    for preset, dtype_name, full in CASES:
        launches, splits = _record_launches(preset, dtype_name, full)
        for name, kernel, grid, args, kwargs in launches:
            if not _in_shard(shard, name):
                continue
            tuned = hasattr(kernel, "configs")
            if tuned:
                mod = sys.modules[kernel.fn.__module__]
                n_cfg = len(mod._cuda_configs())
                assert len(kernel.configs) == n_cfg, (
                    f"{name}: autotuner has {len(kernel.configs)} configs"
                )
                cfg_lists[name] = n_cfg
                if name == "extend":
                    pick = (
                        SUBSET_EXTEND_CONFIGS
                        if not full
                        else range(n_cfg)
                        if args[12] == 0
                        else BUCKET1_CONFIGS
                    )
                else:
                    pick = range(n_cfg) if full else SUBSET_DECODE_CONFIGS
                variants = [(i, kernel.configs[i].all_kwargs()) for i in pick]
                fn = kernel.fn
            else:
                variants, fn = [(None, {})], kernel
            for cfg_index, cfg_kwargs in variants:
                full_kwargs = {**kwargs, **cfg_kwargs}
                label = {
                    "kernel": name,
                    "preset": preset,
                    "dtype": dtype_name,
                    "config": cfg_index,
                    "num_warps": full_kwargs.get("num_warps", 4),
                    "num_stages": full_kwargs.get("num_stages", 3),
                    "constexprs": _constexprs(fn, full_kwargs),
                    "len_bucket": args[12] if name == "extend" else None,
                    "num_kv_splits": args[9]
                    if name == "decode_split"
                    else (args[3] if name == "decode_reduce" else None),
                }
                t0 = time.perf_counter()
                try:
                    compiled = fn.warmup(*args, grid=grid, **full_kwargs)
                except Exception as e:  # noqa: BLE001
                    result["errors"].append(
                        {
                            **label,
                            "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-6000:],
                        }
                    )
                    dump()
                    continue
                if id(compiled) in seen:  # same specialisation as an earlier launch: compiled once
                    entry = result["compiles"][seen[id(compiled)]]
                    entry["launches"] += 1
                    if label["num_kv_splits"] not in entry["split_counts"]:
                        entry["split_counts"].append(label["num_kv_splits"])
                    continue
                seen[id(compiled)] = len(result["compiles"])
                md = compiled.metadata
                result["compiles"].append(
                    {
                        **label,
                        "seconds": round(time.perf_counter() - t0, 2),
                        "arch": md.target.arch,
                        "shared": md.shared,
                        "ptx_chars": len(compiled.asm.get("ptx", "")),
                        "cubin_bytes": len(compiled.asm.get("cubin", b"")),
                        "launches": 1,
                        "split_counts": [label["num_kv_splits"]],
                        "ptx_target": next(
                            (
                                ln.split()[1]
                                for ln in compiled.asm.get("ptx", "").splitlines()
                                if ln.startswith(".target")
                            ),
                            None,
                        ),
                    }
                )
                dump()
        result.setdefault("splits", {})[f"{preset}/{dtype_name}"] = splits
    result["config_counts"] = cfg_lists
    dump()


# ---------------------------------------------------------------------------------------- test side


def _run_workers(tmp_path):
    env = dict(
        os.environ,
        TRITON_INTERPRET="0",
        TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
        TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"),
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    )
    shards = ["0", "1"] if (os.cpu_count() or 1) >= 2 else ["all"]
    procs = []
    for shard in shards:
        out, log = tmp_path / f"compiles-{shard}.json", open(tmp_path / f"worker-{shard}.log", "w+")
        procs.append(
            (
                out,
                log,
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), str(out), shard],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    try:
        return _collect(procs)
    finally:
        for _, log, proc in procs:  # after a failure, stop the other worker too
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def _collect(procs):
    merged = {"compiles": [], "errors": [], "skip": None, "splits": {}, "config_counts": {}}
    deadline = time.monotonic() + TIMEOUT_S
    for out, log, proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
        log.seek(0)
        text = log.read()
        if not out.exists():
            pytest.fail(f"compile worker produced no result (rc {rc}):\n{text[-8000:]}")
        result = json.loads(out.read_text())
        if rc != 0:
            pytest.fail(
                f"compile worker failed (rc {rc}) after {len(result['compiles'])} compiles:\n{text[-8000:]}"
            )
        merged["skip"] = merged["skip"] or result["skip"]
        for key in ("compiles", "errors"):
            merged[key] += result[key]
        for key in ("splits", "config_counts"):
            merged[key].update(result.get(key, {}))
        for key in ("ptxas", "triton"):
            merged.setdefault(key, result.get(key))
    return merged


def test_kernels_compile_for_sm90(tmp_path):
    result = _run_workers(tmp_path)
    if result["skip"]:
        pytest.skip(result["skip"])

    errors = result["errors"]
    assert not errors, f"{len(errors)} kernel compile(s) failed for sm_{ARCH}:\n" + "\n\n".join(
        f"{e['kernel']} {e['preset']}/{e['dtype']} config {e['config']} (warps {e['num_warps']}, stages "
        f"{e['num_stages']}) {e['constexprs']}:\n{e['traceback']}"
        for e in errors
    )

    compiles = result["compiles"]
    for c in compiles:
        where = f"{c['kernel']} {c['preset']}/{c['dtype']} config {c['config']} {c['constexprs']}"
        assert c["arch"] == ARCH and c["ptx_target"] in (f"sm_{ARCH}a", f"sm_{ARCH}"), where
        assert c["ptx_chars"] > 0 and c["cubin_bytes"] > 0, f"empty PTX/cubin: {where}"

    # Everything the backend launches was compiled, for every preset/dtype and every tuned config.
    print(
        f"\n{len(compiles)} sm_{ARCH} compiles ({sum(c['launches'] for c in compiles)} launches) in "
        f"{sum(c['seconds'] for c in compiles):.1f} s; {result.get('ptxas')}, Triton {result.get('triton')}"
    )
    assert set(result["config_counts"]) == {
        "extend",
        "decode_split",
    }  # sizes of the _cuda_configs() lists
    for preset, dtype, full in CASES:
        got = {c["kernel"] for c in compiles if (c["preset"], c["dtype"]) == (preset, dtype)}
        assert got == {"extend", "decode_split", "decode_reduce", "write_kv"}, (preset, dtype, got)
        if full:
            for kernel, n_cfg in result["config_counts"].items():
                cfgs = {
                    c["config"]
                    for c in compiles
                    if (c["kernel"], c["preset"], c["dtype"]) == (kernel, preset, dtype)
                }
                assert cfgs == set(range(n_cfg)), (kernel, preset, dtype, cfgs)
            assert {
                c["len_bucket"]
                for c in compiles
                if c["kernel"] == "extend" and c["preset"] == preset
            } == {0, 1}
    assert result["splits"]["large/bfloat16"] == list(range(1, 65))

    # Shared memory: per (kernel, shape), at least one tuned config fits on an H200; untuned ones must fit.
    groups = {}
    for c in compiles:  # the configs of one launch differ only in their tiles, warps and stages
        key = (c["kernel"], c["preset"], c["dtype"], c["len_bucket"], c["num_kv_splits"])
        groups.setdefault(key, []).append(c["shared"])
    for key, shared in groups.items():
        if key[0] in ("extend", "decode_split"):
            assert min(shared) <= H200_MAX_SHARED, (
                f"no config of {key} fits in shared memory: {shared}"
            )
        else:
            assert max(shared) <= H200_MAX_SHARED, f"{key} needs {shared} bytes of shared memory"


if __name__ == "__main__":
    _worker(*sys.argv[1:])
