// The GPU's expanded program. Contract: gpu_program.h.
#include "schedule/gpu_program.h"

#include <algorithm>

#include "common/errors.h"

namespace kog::schedule {

namespace {

void add_dep(Op& o, int32_t d) {
  for (int k = 0; k < o.n_deps; ++k)
    if (o.deps[k] == d) return;
  KOG_CHECK(o.n_deps < kMaxDeps, "gpu program: an op needs more than ", kMaxDeps, " deps");
  o.deps[o.n_deps++] = d;
  std::sort(o.deps, o.deps + o.n_deps);
}

}  // namespace

std::vector<Op> expand_gpu_program(const std::vector<Op>& ops, const ModelDims& dims) {
  validate_program(ops, dims);
  // produced[i]: the expanded index whose completion means op i's output is complete.
  std::vector<int32_t> produced(ops.size());
  std::vector<Op> out;
  out.reserve(ops.size() + size_t(dims.n_layers));
  int32_t last_combine = -1;
  for (size_t i = 0; i < ops.size(); ++i) {
    Op o = ops[i];
    o.n_deps = 0;
    for (int k = 0; k < ops[i].n_deps; ++k) add_dep(o, produced[size_t(ops[i].deps[k])]);
    const bool attn = Opcode(o.op) == Opcode::kAttnDecode;
    if (attn && last_combine >= 0) add_dep(o, last_combine);
    out.push_back(o);
    produced[i] = int32_t(out.size()) - 1;
    if (attn) {
      // Partials go to the executor's own scratch; the combine writes the attention output.
      Op combine = o;
      combine.op = kOpAttnCombine;
      combine.n_deps = 1;
      combine.deps[0] = produced[i];
      out.push_back(combine);
      produced[i] = last_combine = int32_t(out.size()) - 1;
    }
  }
  return out;
}

std::vector<int32_t> program_sinks(const std::vector<Op>& ops) {
  std::vector<char> has_dependent(ops.size(), 0);
  for (const Op& o : ops)
    for (int k = 0; k < o.n_deps; ++k) has_dependent[size_t(o.deps[k])] = 1;
  std::vector<int32_t> sinks;
  for (size_t i = 0; i < ops.size(); ++i)
    if (!has_dependent[i]) sinks.push_back(int32_t(i));
  // Deps point backwards, so nothing can depend on the last op.
  KOG_ASSERT(ops.empty() || (!sinks.empty() && size_t(sinks.back()) == ops.size() - 1),
             "program_sinks: the last op has a dependent");
  return sinks;
}

}  // namespace kog::schedule
