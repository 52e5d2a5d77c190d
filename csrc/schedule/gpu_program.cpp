#include "schedule/gpu_program.h"

#include "common/errors.h"

namespace kog::schedule {

namespace {

bool valid_buffer(int32_t b) { return b >= 0 && b < int32_t(Buffer::kNumBuffers); }

void check_op(const GpuOp& o, size_t i, int32_t n_layers) {
  KOG_CHECK(o.op >= 0 && o.op < int32_t(Opcode::kNumOpcodes), "gpu program: op ", i, " has opcode ", o.op);
  const auto op = Opcode(o.op);
  KOG_CHECK(o.layer >= -1 && o.layer < n_layers, "gpu program: op ", i, " names layer ", o.layer);
  const bool per_layer = op == Opcode::kKvAppend || op == Opcode::kAttnDecode || op == Opcode::kQkNorm;
  KOG_CHECK(!per_layer || o.layer >= 0, "gpu program: op ", i, " needs a layer");
  KOG_CHECK(o.in < 0 || valid_buffer(o.in), "gpu program: op ", i, " reads buffer ", o.in);
  KOG_CHECK(o.out < 0 || valid_buffer(o.out), "gpu program: op ", i, " writes buffer ", o.out);
  KOG_CHECK(o.residual < 0 || valid_buffer(o.residual), "gpu program: op ", i, " residual ", o.residual);
  KOG_CHECK(o.in >= 0, "gpu program: op ", i, " reads no buffer");
  const bool writes = op != Opcode::kKvAppend;
  KOG_CHECK(!writes || o.out >= 0, "gpu program: op ", i, " writes no buffer");
  const bool weighted = op == Opcode::kEmbed || op == Opcode::kRmsNorm || op == Opcode::kLinear;
  KOG_CHECK(!weighted || o.w0 != nullptr, "gpu program: op ", i, " has no weight");
  KOG_CHECK(op != Opcode::kQkNorm || (o.w0 != nullptr && o.w1 != nullptr), "gpu program: op ", i,
            " needs q and k norm weights");
  KOG_CHECK(op != Opcode::kLinear || o.out != int32_t(Buffer::kTokens), "gpu program: op ", i,
            " writes the token buffer");
}

}  // namespace

std::vector<GpuOp> expand_gpu_program(const std::vector<GpuOp>& schedule_ops, int32_t n_layers) {
  KOG_CHECK(!schedule_ops.empty(), "gpu program: no ops");
  std::vector<GpuOp> out;
  out.reserve(schedule_ops.size() + size_t(n_layers));
  for (size_t i = 0; i < schedule_ops.size(); ++i) {
    const GpuOp& o = schedule_ops[i];
    check_op(o, i, n_layers);
    out.push_back(o);
    if (Opcode(o.op) == Opcode::kAttnDecode) {
      // Partials go to the executor's own scratch; the combine writes the attention output.
      GpuOp combine = o;
      combine.op = kOpAttnCombine;
      out.push_back(combine);
    }
  }
  const Opcode last = Opcode(out.back().op);
  KOG_CHECK(last == Opcode::kSample, "gpu program: the last op must be SAMPLE");
  return out;
}

}  // namespace kog::schedule
