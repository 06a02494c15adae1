"""``cpu_paged`` backend: CPU decode attention straight from the paged KV cache.

The SDPA backend's decode gathers every sequence's K/V out of the paged cache
into a padded ``[2, B, L, Hkv, D]`` copy and then runs SDPA with a key-padding
mask: the cache is read, written and read again. Here a small C++ kernel reads
each cached row once, in place, through the block table: one query token per
sequence, a numerically stable online softmax (running max, fp32 accumulation)
per (sequence, query head), the query heads of one KV group sharing each K/V row
(GQA: head ``h`` reads KV head ``h // (H // Hkv)``). A work item is one sequence
with all its heads, so each cached row is read front to back once (when the batch
is smaller than the thread count, a sequence's KV heads are split over items);
items are spread by ``at::parallel_for``, so ``torch.set_num_threads`` bounds it
like any ATen op. Prefill attention and the K/V write are the SDPA backend's.

The kernel is compiled on first use (a few seconds, once per machine and torch
version) into ``$DISTSERVE_CACHE_DIR/torch_extensions`` or
``~/.cache/distserve/torch_extensions`` (``$DISTSERVE_TORCH_EXTENSIONS_DIR``
overrides), through ``torch.utils.cpp_extension.load_inline`` when ninja is
installed and a direct compiler call otherwise. Flags: ``-O3``, plus
``-march=native`` when the compiler accepts it (the build is keyed by the CPU's
model and flags, so a shared home directory never hands one machine's binary to
another); no ``-ffast-math``. When it cannot be built (no compiler, a build
error, or ``DISTSERVE_DISABLE_CPU_PAGED=1``), :func:`available` is False, the
reason is logged once, and ``auto`` falls back to ``sdpa``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from distserve.server.engine.attention.base import AttentionMetadata
from distserve.server.engine.attention.sdpa import SdpaBackend

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The namespace placeholder __NS__ becomes the op namespace (one per build key), so two
# builds can even be loaded into one process without clashing.
_CPP_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 32;  // keys scored between two softmax rescales

// 8 floats: GCC/Clang vector extension, lowered to AVX/NEON/SSE or scalar code as the target has.
// Explicit vectors keep the sums vectorized without -ffast-math (no reassociation is needed).
typedef float v8 __attribute__((vector_size(32)));
inline v8 ld(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void st(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(v8 a) {
  float t[8];
  std::memcpy(t, &a, sizeof t);
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  v8 s0 = {}, s1 = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    s0 += ld(a + d) * ld(b + d);
    s1 += ld(a + d + 8) * ld(b + d + 8);
  }
  if (d + 8 <= n) { s0 += ld(a + d) * ld(b + d); d += 8; }
  float s = hsum(s0 + s1);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// acc[0:n] += sum_j p[j] * (rows[j] + off)[0:n], the accumulator held in registers 32 lanes at a time
inline void pv(float* __restrict acc, const float* __restrict p, const float* const* rows, int64_t off,
               int64_t cnt, int64_t n) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    v8 r0 = ld(acc + c), r1 = ld(acc + c + 8), r2 = ld(acc + c + 16), r3 = ld(acc + c + 24);
    for (int64_t j = 0; j < cnt; ++j) {
      const float* v = rows[j] + off + c;
      const float pj = p[j];
      r0 += pj * ld(v);
      r1 += pj * ld(v + 8);
      r2 += pj * ld(v + 16);
      r3 += pj * ld(v + 24);
    }
    st(acc + c, r0); st(acc + c + 8, r1); st(acc + c + 16, r2); st(acc + c + 24, r3);
  }
  for (; c + 8 <= n; c += 8) {
    v8 r0 = ld(acc + c);
    for (int64_t j = 0; j < cnt; ++j) r0 += p[j] * ld(rows[j] + off + c);
    st(acc + c, r0);
  }
  for (; c < n; ++c) {
    float r = acc[c];
    for (int64_t j = 0; j < cnt; ++j) r += p[j] * rows[j][off + c];
    acc[c] = r;
  }
}

// One work item = one sequence and a contiguous range of its KV heads (all of them unless the batch is
// smaller than the thread count), so each cached row is read front to back, once.
template <typename T>
void decode_kernel(const T* q, const T* kv, const int64_t* tables, const int64_t* lens, T* out,
                   int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t bs,
                   int64_t plane, float scale, int64_t hsplit, int64_t grain) {
  constexpr bool kFloat = std::is_same<T, float>::value;
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements per cache slot
  const int64_t hk = (Hkv + hsplit - 1) / hsplit;  // KV heads per item
  at::parallel_for(0, B * hsplit, grain, [&](int64_t begin, int64_t end) {
    const int64_t hq = hk * G;  // query heads per item (at most)
    std::vector<float> buf(2 * hq * D + hq * kTile + 2 * hq);
    float* qf = buf.data();
    float* acc = qf + hq * D;
    float* s = acc + hq * D;  // [hq, kTile] scores, then probabilities
    float* m = s + hq * kTile;
    float* l = m + hq;
    std::vector<float> conv(kFloat ? 0 : 2 * kTile * hk * D);  // K/V tile upcast (bf16/fp16)
    const float* krows[kTile];
    const float* vrows[kTile];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hsplit;
      const int64_t g0 = (item % hsplit) * hk, g1 = std::min(Hkv, g0 + hk);
      if (g0 >= g1) continue;
      const int64_t nq = (g1 - g0) * G;  // query heads h0 .. h0 + nq
      const int64_t h0 = g0 * G;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const T* qb = q + (b * H + h0) * D;
      for (int64_t i = 0; i < nq * D; ++i) qf[i] = static_cast<float>(qb[i]);
      std::fill(acc, acc + nq * D, 0.f);
      std::fill(m, m + nq, -std::numeric_limits<float>::infinity());
      std::fill(l, l + nq, 0.f);
      int64_t blk = 0, off = 0;  // position of the next key in the block table
      for (int64_t t0 = 0; t0 < len; t0 += kTile) {
        const int64_t n = std::min(kTile, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* kr = kv + (table[blk] * bs + off) * row + g0 * D;
          if (++off == bs) { off = 0; ++blk; }
          if constexpr (kFloat) {
            krows[j] = kr;
            vrows[j] = kr + plane;
          } else {
            const int64_t w = (g1 - g0) * D;
            float* kc = conv.data() + j * w;
            float* vc = conv.data() + (kTile + j) * w;
            for (int64_t i = 0; i < w; ++i) kc[i] = static_cast<float>(kr[i]);
            for (int64_t i = 0; i < w; ++i) vc[i] = static_cast<float>(kr[plane + i]);
            krows[j] = kc;
            vrows[j] = vc;
          }
          for (int64_t h = 0; h < nq; ++h) s[h * kTile + j] = dot(qf + h * D, krows[j] + (h / G) * D, D) * scale;
        }
        for (int64_t h = 0; h < nq; ++h) {
          float* sh = s + h * kTile;
          float mx = m[h];
          for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sh[j]);
          const float alpha = std::exp(m[h] - mx);  // 0 on the first tile (m = -inf)
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) {
            sh[j] = std::exp(sh[j] - mx);
            sum += sh[j];
          }
          l[h] = l[h] * alpha + sum;
          m[h] = mx;
          float* ah = acc + h * D;
          if (alpha != 1.f)
            for (int64_t d = 0; d < D; ++d) ah[d] *= alpha;
          pv(ah, sh, vrows, (h / G) * D, n, D);
        }
      }
      T* ob = out + (b * H + h0) * D;
      for (int64_t h = 0; h < nq; ++h) {
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; ++d) ob[h * D + d] = static_cast<T>(acc[h * D + d] * inv);
      }
    }
  });
}

void paged_decode_out(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, int64_t block_size, at::Tensor& out) {
  const at::Tensor* all[] = {&q, &kv_cache, &block_tables, &seq_lens, &out};
  for (const at::Tensor* t : all) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "cpu_paged: all tensors must be on the CPU");
    TORCH_CHECK_VALUE(t->is_contiguous(), "cpu_paged: all tensors must be contiguous");
  }
  TORCH_CHECK_VALUE(q.dim() == 3 && kv_cache.dim() == 4 && block_tables.dim() == 2 && seq_lens.dim() == 1,
                    "cpu_paged: expected q [B,H,D], kv_cache [2,N,Hkv,D], block_tables [B,M], seq_lens [B]");
  const auto dt = q.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                    "cpu_paged: dtype must be float32, bfloat16 or float16");
  TORCH_CHECK_VALUE(kv_cache.scalar_type() == dt && out.scalar_type() == dt,
                    "cpu_paged: q, kv_cache and out must share a dtype");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
                    "cpu_paged: block_tables and seq_lens must be int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t N = kv_cache.size(1), Hkv = kv_cache.size(2);
  const int64_t M = block_tables.size(1);
  TORCH_CHECK_VALUE(block_size >= 1, "cpu_paged: block_size must be positive");
  TORCH_CHECK_VALUE(kv_cache.size(0) == 2 && kv_cache.size(3) == D && Hkv >= 1 && H % Hkv == 0,
                    "cpu_paged: kv_cache shape does not match q");
  TORCH_CHECK_VALUE(N % block_size == 0, "cpu_paged: kv_cache rows are not a whole number of blocks");
  TORCH_CHECK_VALUE(block_tables.size(0) == B && seq_lens.size(0) == B, "cpu_paged: batch sizes differ");
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "cpu_paged: out must have q's shape");
  TORCH_CHECK_VALUE(std::isfinite(scale), "cpu_paged: scale must be finite");
  if (B == 0 || H == 0 || D == 0) return;
  const int64_t NB = N / block_size;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) {  // every row the kernel will touch is inside the cache
    const int64_t len = lens[b];
    TORCH_CHECK_VALUE(len >= 1 && len <= M * block_size, "cpu_paged: seq_lens[", b, "] = ", len,
                      " is outside [1, ", M * block_size, "] (block table width x block size)");
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t i = 0; i < used; ++i) {
      const int64_t id = tables[b * M + i];
      TORCH_CHECK_VALUE(id >= 0 && id < NB, "cpu_paged: block_tables[", b, ", ", i, "] = ", id,
                        " is outside [0, ", NB, ")");
    }
    max_len = std::max(max_len, len);
  }
  const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t hsplit = B >= nthreads ? 1 : std::min<int64_t>(Hkv, (nthreads + B - 1) / B);
  const int64_t per_item = max_len * (H / hsplit) * D;  // multiply-adds per item, roughly
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, per_item));
  const int64_t plane = N * Hkv * D;
  const float sc = static_cast<float>(scale);
  switch (dt) {
    case at::kFloat:
      decode_kernel<float>(q.data_ptr<float>(), kv_cache.data_ptr<float>(), tables, lens,
                           out.data_ptr<float>(), B, H, Hkv, D, M, block_size, plane, sc, hsplit, grain);
      break;
    case at::kBFloat16:
      decode_kernel<c10::BFloat16>(q.data_ptr<c10::BFloat16>(), kv_cache.data_ptr<c10::BFloat16>(), tables,
                                   lens, out.data_ptr<c10::BFloat16>(), B, H, Hkv, D, M, block_size, plane,
                                   sc, hsplit, grain);
      break;
    default:
      decode_kernel<c10::Half>(q.data_ptr<c10::Half>(), kv_cache.data_ptr<c10::Half>(), tables, lens,
                               out.data_ptr<c10::Half>(), B, H, Hkv, D, M, block_size, plane, sc, hsplit, grain);
  }
}

}  // namespace

TORCH_LIBRARY(__NS__, m) {
  m.def("paged_decode_out(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int block_size, Tensor(a!) out) -> ()", &paged_decode_out);
}
"""

# ----------------------------------------------------------------------------- build + load

_lock = threading.Lock()
_state: dict = {}  # "op": the loaded op, or "error": why there is none; "build_s", "cached", "path"


def _cache_root() -> Path:
    explicit = os.environ.get("DISTSERVE_TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    root = os.environ.get("DISTSERVE_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "torch_extensions"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "distserve" / "torch_extensions"


def _cpu_fingerprint() -> str:
    """The CPU's model and feature flags: a -march=native binary is only reused on a matching CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            keep = []
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part"):
                    keep.append(line.strip())
                elif not line.strip() and keep:  # first processor only
                    break
            if keep:
                return "\n".join(keep)
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _build_key() -> str:
    h = hashlib.sha256()
    for part in (_CPP_SOURCE, torch.__version__, sys.version.split()[0], _cpu_fingerprint()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx)


def _accepts(cxx: str, flag: str) -> bool:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text("int main() { return 0; }\n")
        try:
            r = subprocess.run([cxx, flag, str(src), "-o", str(Path(d) / "probe")], capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        return r.returncode == 0


def _ninja_available() -> bool:
    try:
        from torch.utils.cpp_extension import is_ninja_available

        return is_ninja_available()
    except Exception:
        return False


def _build_direct(cxx: str, source: str, name: str, build_dir: Path, cflags: list[str]) -> Path:
    """One compiler call, no ninja: compile + link to ``name.so``, published by an atomic rename."""
    from torch.utils.cpp_extension import include_paths

    build_dir.mkdir(parents=True, exist_ok=True)
    target = build_dir / f"{name}.so"
    src = build_dir / "main.cpp"
    tmp_src = build_dir / f".main.{os.getpid()}.cpp"
    tmp_src.write_text(source)
    os.replace(tmp_src, src)
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    tmp = build_dir / f".{name}.{os.getpid()}.so"
    cmd = [cxx, "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *cflags]
    for inc in include_paths():  # the CPU ones (the argument changed type across torch versions)
        cmd += ["-isystem", inc]
    cmd += [str(src), "-o", str(tmp), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compile failed ({' '.join(cmd[:3])} ...):\n{(r.stderr or r.stdout)[-2000:]}")
    os.replace(tmp, target)  # concurrent builders each publish a complete file
    return target


def _build_with_load_inline(source: str, name: str, build_dir: Path, cflags: list[str]) -> None:
    from torch.utils.cpp_extension import load_inline

    build_dir.mkdir(parents=True, exist_ok=True)
    load_inline(
        name=name,
        cpp_sources=[source],
        extra_cflags=cflags,
        build_directory=str(build_dir),
        is_python_module=False,
        no_implicit_headers=True,
        verbose=False,
    )


def _load_op():
    """The compiled op (building it on first use); RuntimeError when it cannot be had."""
    with _lock:
        if "op" in _state:
            return _state["op"]
        if "error" in _state:
            raise RuntimeError(_state["error"])
        try:
            _state["op"] = _load_op_locked()
            return _state["op"]
        except Exception as e:  # no compiler, compile error, unloadable library
            msg = str(e)
            if len(msg) > 3000:  # a compiler log: its end says what failed
                msg = "..." + msg[-3000:]
            _state["error"] = f"cpu_paged attention unavailable: {msg}"
            log.warning("%s (attention_backend=auto uses sdpa)", _state["error"])
            raise RuntimeError(_state["error"]) from e


def _load_op_locked():
    if os.environ.get("DISTSERVE_DISABLE_CPU_PAGED", "").strip() not in ("", "0"):
        raise RuntimeError("disabled by DISTSERVE_DISABLE_CPU_PAGED")
    if sys.platform == "win32":
        raise RuntimeError("the CPU kernel is built for Linux/macOS compilers only")
    name = f"distserve_cpu_paged_{_build_key()}"
    source = _CPP_SOURCE.replace("__NS__", name)
    build_dir = _cache_root() / name
    t0 = time.perf_counter()
    lib = build_dir / f"{name}.so"
    cached = lib.is_file()
    if cached:
        try:
            torch.ops.load_library(str(lib))
        except Exception as e:  # half-written by a concurrent build, or stale: build it again
            log.info("cannot load %s (%s); rebuilding", lib, e)
            cached = False
    if not cached:
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not on PATH)")
        cflags = ["-O3"] + (["-march=native"] if _accepts(cxx, "-march=native") else [])
        log.info("building the cpu_paged attention kernel in %s (once per machine)", build_dir)
        if _ninja_available():
            _build_with_load_inline(source, name, build_dir, cflags)  # loads it, too
            found = sorted(build_dir.glob(f"{name}*.so"), key=lambda p: p.stat().st_mtime)
            if not found:
                raise RuntimeError(f"load_inline left no library in {build_dir}")
            if found[-1] != lib:
                shutil.copyfile(found[-1], lib)
        else:
            _build_direct(cxx, source, name, build_dir, cflags)
            torch.ops.load_library(str(lib))
    op = getattr(torch.ops, name).paged_decode_out
    _state.update(build_s=time.perf_counter() - t0, cached=cached, path=str(lib))
    log.info("cpu_paged attention kernel %s in %.1f s (%s)", "loaded" if cached else "built", _state["build_s"], lib)
    return op


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if needed); the reason for False is logged once."""
    try:
        _load_op()
        return True
    except RuntimeError:
        return False


def unavailable_reason() -> str | None:
    available()
    return _state.get("error")


def build_info() -> dict:
    """``build_s`` (seconds spent building or loading), ``cached`` (found built) and ``path`` of the library."""
    available()
    return {k: _state[k] for k in ("build_s", "cached", "path", "error") if k in _state}


# ----------------------------------------------------------------------------- the op


def _validate(q, kv_cache, block_tables, seq_lens, scale, block_size, out) -> None:
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks*block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from q dtype {q.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    b, h, d = q.shape
    hkv = kv_cache.shape[2]
    if kv_cache.shape[3] != d:
        raise ValueError(f"head_dim differs: q {d}, kv_cache {kv_cache.shape[3]}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if kv_cache.shape[1] % block_size:
        raise ValueError(f"kv_cache has {kv_cache.shape[1]} rows, not a multiple of block_size {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int64:
        raise ValueError(
            f"block_tables must be int64 [B={b}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dim() != 1 or seq_lens.shape[0] != b or seq_lens.dtype != torch.int64:
        raise ValueError(f"seq_lens must be int64 [B={b}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    if out is not None:
        if (
            not isinstance(out, torch.Tensor)
            or out.device.type != "cpu"
            or out.dtype != q.dtype
            or out.shape != q.shape
            or not out.is_contiguous()
        ):
            raise ValueError("out must be a contiguous CPU tensor with q's shape and dtype")


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention from the paged cache: ``q [B, H, D]`` -> ``[B, H, D]`` (q's dtype).

    ``kv_cache [2, num_blocks*block_size, Hkv, D]``; ``block_tables [B, max_blocks]`` int64 (entries past
    a sequence's last block are ignored); ``seq_lens [B]`` int64, each in ``[1, max_blocks*block_size]``.
    Raises ValueError on bad shapes, dtypes, devices, lengths or block ids; RuntimeError when the
    kernel is unavailable (see :func:`available`).
    """
    _validate(q, kv_cache, block_tables, seq_lens, scale, block_size, out)
    op = _load_op()
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    op(q, kv_cache, block_tables.contiguous(), seq_lens.contiguous(), float(scale), int(block_size), out)
    return out


class CpuPagedBackend(SdpaBackend):
    """SDPA for K/V writes and prefills; the paged C++ kernel for decodes (CPU only)."""

    name = "cpu_paged"

    def __init__(self) -> None:
        _load_op()  # build now (engine construction), not in the middle of the first step

    @staticmethod
    def available() -> bool:
        return available()

    @staticmethod
    def _decode(q, kv_cache, meta: AttentionMetadata, scale: float, gqa: bool):
        block_tables, seq_lens = meta.decode_inputs()
        return paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, meta.block_size)


__all__ = ["CpuPagedBackend", "paged_decode_attention", "available", "unavailable_reason", "build_info"]
