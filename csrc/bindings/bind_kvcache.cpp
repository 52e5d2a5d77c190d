// Binds the paged KV allocator (kog::kv), its CPU block copy, and the sequence-level enums the
// Python engine mirrors (KVSeqState, FinishReason). The Python facade is kog/kvcache.py; arrays
// cross as numpy (token ids int32, sequence ids int64, block tables int32).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>

#include "common/errors.h"
#include "common/finish_reason.h"
#include "kvcache/allocator.h"
#include "gpu/launch.h"
#include "kvcache/kv_copy.h"

namespace py = pybind11;
using namespace kog::kv;

namespace {

using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// A numpy view of a vector owned by `owner` (no copy; the array keeps owner alive).
template <typename T>
py::array view(const std::vector<T>& v, std::vector<py::ssize_t> shape, py::handle owner) {
  return py::array_t<T>(shape, v.empty() ? nullptr : v.data(), owner);
}

py::array pairs_view(const std::vector<std::pair<int32_t, int32_t>>& v, py::handle owner) {
  static_assert(sizeof(std::pair<int32_t, int32_t>) == 2 * sizeof(int32_t), "packed pairs");
  return py::array_t<int32_t>({static_cast<py::ssize_t>(v.size()), py::ssize_t{2}},
                              v.empty() ? nullptr : &v.front().first, owner);
}

const int64_t* ids_ptr(const I64& ids, const char* op) {
  KOG_CHECK(ids.ndim() == 1, op, ": sequence ids must be a 1-D array");
  return ids.data();
}

// Sequence ids and per-sequence token counts of a batch append (1-D, equal lengths).
void check_batch(const I64& seqs, const I64& counts, const char* op) {
  KOG_CHECK(seqs.ndim() == 1 && counts.ndim() == 1 && seqs.size() == counts.size(), op,
            ": seqs and counts must be 1-D of equal length");
}

const int32_t* tokens_ptr(const I32& t) {
  KOG_CHECK(t.ndim() == 1, "token ids must be a 1-D array");
  return t.size() ? t.data() : nullptr;
}

py::dict seq_info(const SeqInfo& s) {
  py::dict d;
  d["state"] = s.state;
  d["tail"] = s.tail;
  d["num_tokens"] = s.num_tokens;
  d["named"] = s.named;
  d["tokens_known"] = s.tokens_known;
  d["host_blocks"] = s.host_blocks;
  return d;
}

py::dict stats_dict(const Stats& s) {
  py::dict d;
#define KOG_STAT(name) d[#name] = s.name
  KOG_STAT(num_blocks); KOG_STAT(blocks_free); KOG_STAT(blocks_used); KOG_STAT(blocks_cached);
  KOG_STAT(blocks_pinned); KOG_STAT(num_host_blocks); KOG_STAT(host_blocks_free);
  KOG_STAT(blocks_swapped); KOG_STAT(num_sequences); KOG_STAT(prefix_queries);
  KOG_STAT(prefix_query_tokens); KOG_STAT(prefix_hit_tokens); KOG_STAT(cow_copies);
  KOG_STAT(evictions); KOG_STAT(blocks_swapped_out); KOG_STAT(blocks_swapped_in);
  KOG_STAT(bytes_swapped_out); KOG_STAT(bytes_swapped_in);
#undef KOG_STAT
  return d;
}

py::dict debug_state(const KVCacheAllocator& a) {
  const BlockPool& p = a.pool();
  std::vector<int32_t> ref, parent;
  std::vector<bool> hashed, registered;
  for (int32_t b = 0; b < p.num_blocks(); ++b) {
    ref.push_back(p.ref(BlockId(b)));
    parent.push_back(p.parent(BlockId(b)).value);
    hashed.push_back(p.hashed(BlockId(b)));
    registered.push_back(p.registered(BlockId(b)));
  }
  py::dict cache;
  for (const auto& kv : p.cache_map()) cache[py::int_(kv.first.value)] = kv.second;
  py::dict seqs;
  for (int64_t id : a.sequence_ids()) seqs[py::int_(id)] = seq_info(a.info(SeqId(id)));
  py::dict d;
  d["ref"] = ref;
  d["parent"] = parent;
  d["hashed"] = hashed;
  d["registered"] = registered;
  d["free"] = p.free_stack();
  d["lru"] = p.lru_order();
  d["cache"] = cache;
  d["seqs"] = seqs;
  d["pins"] = a.pins();
  d["host_free"] = a.host_free_stack();
  return d;
}

void copy_blocks(uintptr_t dst, int64_t dst_num_blocks, uintptr_t src, int64_t src_num_blocks,
                 int64_t num_layers, int64_t slab_bytes, const I32& pairs) {
  KOG_CHECK(pairs.size() == 0 || (pairs.ndim() == 2 && pairs.shape(1) == 2),
            "copy_blocks: pairs must be [n, 2]");
  BlockCopyParams prm{reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                      num_layers, dst_num_blocks, src_num_blocks, slab_bytes,
                      pairs.size() ? pairs.data() : nullptr, pairs.size() / 2};
  py::gil_scoped_release nogil;
  copy_blocks_cpu(prm);
}

// The GPU twin: pairs (host, validated) and pairs_device (the same on the device) both given.
void copy_blocks_gpu(uintptr_t dst, int64_t dst_num_blocks, bool dst_is_host, uintptr_t src,
                     int64_t src_num_blocks, bool src_is_host, int64_t num_layers,
                     int64_t slab_bytes, const I32& pairs, uintptr_t pairs_device,
                     uintptr_t stream) {
  KOG_CHECK(pairs.size() == 0 || (pairs.ndim() == 2 && pairs.shape(1) == 2),
            "copy_blocks: pairs must be [n, 2]");
  BlockCopyParams prm{reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                      num_layers, dst_num_blocks, src_num_blocks, slab_bytes,
                      pairs.size() ? pairs.data() : nullptr, pairs.size() / 2};
#ifdef KOG_WITH_GPU
  py::gil_scoped_release nogil;
  kog::gpu::copy_blocks(prm, reinterpret_cast<const int32_t*>(pairs_device), dst_is_host,
                        src_is_host, reinterpret_cast<void*>(stream));
#else
  (void)prm, (void)pairs_device, (void)dst_is_host, (void)src_is_host, (void)stream;  // validated, no device
  kog::throw_error(kog::ErrorKind::kBackend, "kv_copy_blocks_gpu: this kog build has no GPU backend");
#endif
}

}  // namespace

void bind_kvcache(py::module_& m) {
  py::enum_<SeqState>(m, "KVSeqState", "Where a sequence's KV is: running (resident, appendable), "
                                       "suspended (resident, swappable) or swapped (host pool).")
      .value("RUNNING", SeqState::kRunning)
      .value("SUSPENDED", SeqState::kSuspended)
      .value("SWAPPED", SeqState::kSwapped);
  py::enum_<kog::FinishReason>(m, "FinishReason", "Why a sequence stopped (NONE: it runs).")
      .value("NONE", kog::FinishReason::kNone)
      .value("STOP", kog::FinishReason::kStop)
      .value("LENGTH", kog::FinishReason::kLength)
      .value("ABORT", kog::FinishReason::kAbort);

  py::class_<Moves>(m, "KVMoves", "Copies the backend must perform: swap_out, swap_in, cow, then "
                                  "the KV writes of the new tokens at `slots`.")
      .def_property_readonly("swap_out", [](py::object self) {
        return pairs_view(self.cast<const Moves&>().swap_out, self); })
      .def_property_readonly("swap_in", [](py::object self) {
        return pairs_view(self.cast<const Moves&>().swap_in, self); })
      .def_property_readonly("cow", [](py::object self) {
        return pairs_view(self.cast<const Moves&>().cow, self); })
      .def_property_readonly("slots", [](py::object self) {
        const auto& s = self.cast<const Moves&>().slots;
        return view(s, {static_cast<py::ssize_t>(s.size())}, self); });

  py::class_<KVCacheAllocator>(m, "KVCacheAllocator")
      .def(py::init([](int32_t num_blocks, int32_t block_size, int32_t num_host_blocks,
                       const std::string& ns, int64_t bytes_per_block) {
             return KVCacheAllocator(
                 KVConfig{num_blocks, block_size, num_host_blocks, ns, bytes_per_block});
           }),
           py::arg("num_blocks"), py::arg("block_size") = 16, py::arg("num_host_blocks") = 0,
           py::arg("cache_namespace") = "", py::arg("bytes_per_block") = 0)
      .def("add_sequence", [](KVCacheAllocator& a, int64_t seq, const I32& tokens) {
             Moves mv;
             const int64_t cached = a.add_sequence(SeqId(seq), tokens_ptr(tokens), tokens.size(), mv);
             return py::make_tuple(cached, std::move(mv));
           })
      .def("append", [](KVCacheAllocator& a, int64_t seq, int64_t n) {
             Moves mv;
             a.append(SeqId(seq), n, nullptr, mv);
             return mv;
           })
      .def("append_tokens", [](KVCacheAllocator& a, int64_t seq, const I32& tokens) {
             Moves mv;
             a.append(SeqId(seq), tokens.size(), tokens_ptr(tokens), mv);
             return mv;
           })
      .def("name_tokens", [](KVCacheAllocator& a, int64_t seq, int64_t start, const I32& ids) {
             a.name_tokens(SeqId(seq), start, tokens_ptr(ids), ids.size());
           })
      .def("append_batch", [](KVCacheAllocator& a, const I64& seqs, const I64& counts,
                              std::optional<I32> tokens) {
             check_batch(seqs, counts, "append_batch");
             const int32_t* ids = nullptr;
             if (tokens) {
               int64_t total = 0;
               for (py::ssize_t i = 0; i < counts.size(); ++i) total += counts.data()[i];
               KOG_CHECK(tokens->ndim() == 1 && tokens->size() == total,
                         "append_batch: tokens must hold sum(counts) = ", total, " ids");
               ids = tokens->size() ? tokens->data() : nullptr;
             }
             Moves mv;
             a.append_batch(seqs.data(), counts.data(), seqs.size(), mv, ids);
             return mv;
           }, py::arg("seqs"), py::arg("counts"), py::arg("tokens") = py::none())
      .def("can_append", [](const KVCacheAllocator& a, int64_t s, int64_t n) {
             return a.can_append(SeqId(s), n); })
      .def("max_appendable", [](const KVCacheAllocator& a, int64_t s) {
             return a.max_appendable(SeqId(s)); })
      .def("max_appendable_batch", [](const KVCacheAllocator& a, const I64& seqs, const I64& counts) {
             check_batch(seqs, counts, "max_appendable_batch");
             return a.max_appendable_batch(seqs.data(), counts.data(), seqs.size());
           })
      .def("fork", [](KVCacheAllocator& a, int64_t p, int64_t c) { a.fork(SeqId(p), SeqId(c)); })
      .def("fork_batch", [](KVCacheAllocator& a, const I64& parents, const I64& children) {
             KOG_CHECK(parents.ndim() == 1 && parents.size() == children.size(),
                       "fork_batch: parents and children must be 1-D of equal length");
             a.fork_batch(parents.data(), children.data(), parents.size());
           })
      .def("truncate", [](KVCacheAllocator& a, int64_t s, int64_t n) { a.truncate(SeqId(s), n); })
      .def("free", [](KVCacheAllocator& a, int64_t s) { a.free(SeqId(s)); })
      .def("free_batch", [](KVCacheAllocator& a, const I64& seqs) {
             KOG_CHECK(seqs.ndim() == 1, "free_batch: seqs must be 1-D");
             a.free_batch(seqs.data(), seqs.size());
           })
      .def("suspend", [](KVCacheAllocator& a, int64_t s) { a.suspend(SeqId(s)); })
      .def("resume", [](KVCacheAllocator& a, int64_t s) { Moves mv; a.resume(SeqId(s), mv); return mv; })
      .def("swap_out", [](KVCacheAllocator& a, int64_t s) { Moves mv; a.swap_out(SeqId(s), mv); return mv; })
      .def("lookup", [](KVCacheAllocator& a, const I32& t) { return a.lookup(tokens_ptr(t), t.size()); })
      .def("pin", [](KVCacheAllocator& a, const I32& t) {
             auto r = a.pin(tokens_ptr(t), t.size());
             return py::make_tuple(r.first.value, r.second);
           })
      .def("unpin", [](KVCacheAllocator& a, int64_t id) { a.unpin(PinId(id)); })
      .def("evict", &KVCacheAllocator::evict, py::arg("n_blocks"))
      .def("block_table", [](KVCacheAllocator& a, int64_t s) {
             const std::vector<int32_t> t = a.block_table(SeqId(s));
             return I32(static_cast<py::ssize_t>(t.size()), t.data());
           })
      .def("block_tables", [](KVCacheAllocator& a, const I64& seqs) {
             const int64_t* ids = ids_ptr(seqs, "block_tables");
             const int64_t width = a.max_table_len(ids, seqs.size());
             py::array_t<int32_t> out({static_cast<py::ssize_t>(seqs.size()), static_cast<py::ssize_t>(width)});
             a.fill_block_tables(ids, seqs.size(), out.mutable_data(), width);
             return out;
           }, "[n, longest table] int32 block tables of resident sequences, rows padded with 0")
      .def("fill_block_tables", [](KVCacheAllocator& a, const I64& seqs, py::array_t<int32_t> out) {
             const int64_t* ids = ids_ptr(seqs, "fill_block_tables");
             KOG_CHECK(out.ndim() == 2 && out.shape(0) == seqs.size() && out.writeable() &&
                           (out.flags() & py::array::c_style),
                       "fill_block_tables: out must be a writable C-contiguous int32 [", seqs.size(),
                       ", width] array");
             a.fill_block_tables(ids, seqs.size(), out.mutable_data(), out.shape(1));
           }, "Writes the padded block tables of resident sequences into out [n, width] int32")
      .def("info", [](const KVCacheAllocator& a, int64_t s) { return seq_info(a.info(SeqId(s))); })
      .def("__contains__", [](const KVCacheAllocator& a, int64_t s) { return a.contains(SeqId(s)); })
      .def("sequence_ids", &KVCacheAllocator::sequence_ids)
      .def_property_readonly("block_size", &KVCacheAllocator::block_size)
      .def("stats", [](const KVCacheAllocator& a) { return stats_dict(a.stats()); })
      .def("debug_state", &debug_state);

  m.def("kv_copy_blocks", &copy_blocks, py::arg("dst"), py::arg("dst_num_blocks"), py::arg("src"),
        py::arg("src_num_blocks"), py::arg("num_layers"), py::arg("slab_bytes"), py::arg("pairs"),
        "Copies (layer, block) slabs between KV tensors on the CPU (GIL released).");
  m.def("kv_copy_blocks_gpu", &copy_blocks_gpu, py::arg("dst"), py::arg("dst_num_blocks"),
        py::arg("dst_is_host"), py::arg("src"), py::arg("src_num_blocks"), py::arg("src_is_host"),
        py::arg("num_layers"), py::arg("slab_bytes"), py::arg("pairs"), py::arg("pairs_device"),
        py::arg("stream"), "Enqueues (layer, block) slab copies on a GPU stream (GIL released).");
}
