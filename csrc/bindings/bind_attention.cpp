// KV append and paged-attention entry points. Tensors arrive as raw addresses plus sizes,
// validated by the typed wrappers in kog/ops.py; for CPU tensors the index arrays are checked
// again here (a cheap scan) so that a direct caller cannot make the kernels read out of bounds.
// device < 0 runs the CPU kernels; device >= 0 enqueues the GPU kernels on `stream` (their
// index arrays are device memory, checked by the Python wrappers before the launch).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/errors.h"
#include "cpu/kernels.h"
#include "gpu/launch.h"

namespace py = pybind11;
using kog::DType;

namespace {

DType float_dtype(int code) {
  KOG_CHECK(code >= 0 && code <= 2, "dtype code ", code, " is not float32/float16/bfloat16");
  return static_cast<DType>(code);
}

// The cache's dtype: kv_dtype's code, or (-1) the activations' dtype.
DType cache_dtype(int kv_dtype, int dtype) { return float_dtype(kv_dtype < 0 ? dtype : kv_dtype); }

void require_gpu_build(const char* op) {
#ifndef KOG_WITH_GPU
  kog::throw_error(kog::ErrorKind::kBackend, op, ": this kog build has no GPU backend (built with KOG_BACKEND=",
                   KOG_BACKEND_NAME, ")");
#endif
}

void kv_append(uintptr_t kv_cache, uintptr_t k, uintptr_t v, uintptr_t slot_mapping,
               int64_t n_tokens, int64_t n_kv_heads, int64_t head_dim, int64_t block_size,
               int64_t num_blocks, int64_t k_stride, int64_t v_stride, int dtype, int64_t device,
               uintptr_t stream, int kv_dtype) {
  KOG_CHECK(n_tokens >= 0 && n_kv_heads > 0 && head_dim > 0 && block_size > 0 && num_blocks > 0,
            "kv_append: bad shape");
  KOG_CHECK(n_tokens == 0 || (kv_cache && k && v && slot_mapping), "kv_append: null tensor");
  kog::KVAppendParams p{reinterpret_cast<void*>(kv_cache), reinterpret_cast<const void*>(k),
                        reinterpret_cast<const void*>(v),
                        reinterpret_cast<const int64_t*>(slot_mapping), n_tokens, n_kv_heads,
                        head_dim, block_size, num_blocks, k_stride, v_stride, float_dtype(dtype),
                        cache_dtype(kv_dtype, dtype)};
  if (device >= 0) {
    require_gpu_build("kv_append");
    KOG_CHECK(p.kv_dtype == p.dtype, "kv_append: a GPU cache has the activations' dtype");
#ifdef KOG_WITH_GPU
    kog::gpu::kv_append(p, reinterpret_cast<void*>(stream));
#endif
    return;
  }
  for (int64_t t = 0; t < n_tokens; ++t)
    KOG_CHECK(p.slot_mapping[t] < num_blocks * block_size, "kv_append: slot_mapping[", t, "] = ",
              p.slot_mapping[t], " is past the cache (", num_blocks, " blocks of ", block_size, ")");
  if (n_tokens == 0) return;
  kog::cpu::kernels().kv_append(p);
}

// The checks every kernel relies on, over host memory.
void check_metadata(const kog::PagedAttentionParams& p, const char* op) {
  for (int64_t s = 0; s < p.n_seqs; ++s) {
    const int64_t len = p.seq_lens[s];
    const int64_t q_len = p.query_start_loc
                              ? int64_t(p.query_start_loc[s + 1]) - p.query_start_loc[s] : 1;
    KOG_CHECK(q_len >= 0 && q_len <= len, op, ": sequence ", s, " has ", q_len,
              " query tokens but seq_len ", len);
    KOG_CHECK(len <= p.max_seq_len && len <= p.max_blocks_per_seq * p.block_size, op,
              ": seq_lens[", s, "] = ", len, " exceeds max_seq_len or the block table");
    const int32_t* row = p.block_tables + s * p.block_tables_stride;
    for (int64_t b = 0; b < (len + p.block_size - 1) / p.block_size; ++b)
      KOG_CHECK(row[b] >= 0 && row[b] < p.num_blocks, op, ": block_tables[", s, ", ", b, "] = ",
                row[b], " is not a block of the cache (", p.num_blocks, " blocks)");
  }
  if (p.query_start_loc) {
    KOG_CHECK(p.query_start_loc[0] == 0 && p.query_start_loc[p.n_seqs] == p.n_tokens, op,
              ": query_start_loc must start at 0 and end at n_tokens = ", p.n_tokens);
    for (int64_t s = 0; s < p.n_seqs; ++s)
      KOG_CHECK(p.query_start_loc[s + 1] - p.query_start_loc[s] <= p.max_q_len, op,
                ": sequence ", s, " has more than max_q_len = ", p.max_q_len, " query tokens");
  }
}

void paged_attention(bool decode, uintptr_t out, uintptr_t q, uintptr_t kv_cache,
                     uintptr_t block_tables, uintptr_t seq_lens, uintptr_t query_start_loc,
                     int64_t n_seqs, int64_t n_tokens, int64_t n_q_heads, int64_t n_kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t num_blocks,
                     int64_t max_blocks_per_seq, int64_t block_tables_stride, int64_t q_stride,
                     int64_t out_stride, int64_t max_seq_len, int64_t max_q_len, float scale,
                     int dtype, int64_t device, uintptr_t stream, uintptr_t partials, int kernel,
                     int64_t window, int kv_dtype) {
  const char* op = decode ? "paged_attention_decode" : "paged_attention_prefill";
  KOG_CHECK(n_seqs >= 0 && n_tokens >= 0 && n_kv_heads > 0 && n_q_heads % n_kv_heads == 0 &&
                n_q_heads > 0 && block_size > 0 && num_blocks > 0 && max_blocks_per_seq >= 0,
            op, ": bad shape");
  KOG_CHECK(head_dim > 0 && head_dim % 16 == 0 && head_dim <= 256, op,
            ": head_dim must be a multiple of 16 in [16, 256], got ", head_dim);
  KOG_CHECK(decode ? (query_start_loc == 0 && n_tokens == n_seqs && max_q_len == 1)
                   : query_start_loc != 0,
            op, decode ? ": one query per sequence" : ": query_start_loc is required");
  KOG_CHECK(n_seqs == 0 || (out && q && kv_cache && block_tables && seq_lens), op, ": null tensor");
  kog::PagedAttentionParams p{
      reinterpret_cast<void*>(out), reinterpret_cast<const void*>(q),
      reinterpret_cast<const void*>(kv_cache), reinterpret_cast<const int32_t*>(block_tables),
      reinterpret_cast<const int32_t*>(seq_lens), reinterpret_cast<const int32_t*>(query_start_loc),
      n_seqs, n_tokens, n_q_heads, n_kv_heads, head_dim, block_size, num_blocks,
      max_blocks_per_seq, block_tables_stride, q_stride, out_stride, max_seq_len, max_q_len,
      scale, float_dtype(dtype), cache_dtype(kv_dtype, dtype), window};
  KOG_CHECK(window >= 0, op, ": window must be >= 0 (0: no sliding window), got ", window);
  KOG_CHECK(kernel >= 0 && kernel <= 2, op, ": kernel must be 0 (auto), 1 (split) or 2 (flash), got ", kernel);
  if (n_seqs == 0) return;
  if (device >= 0) {
    require_gpu_build(op);
    KOG_CHECK(p.kv_dtype == p.dtype, op, ": a GPU cache has the activations' dtype");
#ifdef KOG_WITH_GPU
    kog::gpu::paged_attention(p, reinterpret_cast<float*>(partials), reinterpret_cast<void*>(stream),
                              static_cast<kog::GpuPrefillKernel>(kernel));
#endif
    return;
  }
  check_metadata(p, op);
  if (decode) {
    for (int64_t s = 0; s < n_seqs; ++s)
      KOG_CHECK(p.seq_lens[s] >= 1, op, ": seq_lens[", s, "] must be >= 1 (it includes the new token)");
    kog::cpu::kernels().paged_attention_decode(p);
  } else {
    kog::cpu::kernels().paged_attention_prefill(p);
  }
}

}  // namespace

void bind_attention(py::module_& m) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("kv_append", &kv_append, arg("kv_cache"), arg("k"), arg("v"), arg("slot_mapping"),
        arg("n_tokens"), arg("n_kv_heads"), arg("head_dim"), arg("block_size"),
        arg("num_blocks"), arg("k_stride"), arg("v_stride"), arg("dtype"), arg("device"),
        arg("stream"), arg("kv_dtype") = -1, nogil);
  m.def("paged_attention", &paged_attention, arg("decode"), arg("out"), arg("q"),
        arg("kv_cache"), arg("block_tables"), arg("seq_lens"), arg("query_start_loc"),
        arg("n_seqs"), arg("n_tokens"), arg("n_q_heads"), arg("n_kv_heads"), arg("head_dim"),
        arg("block_size"), arg("num_blocks"), arg("max_blocks_per_seq"),
        arg("block_tables_stride"), arg("q_stride"), arg("out_stride"), arg("max_seq_len"),
        arg("max_q_len"), arg("scale"), arg("dtype"), arg("device"), arg("stream"), arg("partials") = 0,
        arg("kernel") = 0, arg("window") = 0, arg("kv_dtype") = -1, nogil);
  m.def(
      "paged_attention_partials_floats",
      [](int64_t n_tokens, int64_t n_q_heads, int64_t head_dim, int64_t max_seq_len, bool decode, int64_t max_q_len,
         int kernel) {
        return kog::gpu_attention_partials_floats(n_tokens, n_q_heads, head_dim, max_seq_len, decode, max_q_len,
                                                  static_cast<kog::GpuPrefillKernel>(kernel));
      },
      arg("n_tokens"), arg("n_q_heads"), arg("head_dim"), arg("max_seq_len"), arg("decode") = true,
      arg("max_q_len") = 1, arg("kernel") = 0,
      "Floats of device scratch the GPU paged attention needs (0 when it takes the flash prefill kernel).");
  m.attr("GPU_FLASH_PREFILL_MIN_QUERY_LEN") = kog::kGpuFlashPrefillMinQueryLen;
}
