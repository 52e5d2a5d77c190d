// Exposes the schedule's opcode and buffer numbering so Python can check its mirror.
#include <pybind11/pybind11.h>

#include "schedule/opcodes.h"

namespace py = pybind11;
using kog::schedule::Buffer;
using kog::schedule::Opcode;

void bind_schedule(py::module_& m) {
  py::dict ops;
  ops["EMBED"] = int(Opcode::kEmbed);
  ops["RMS_NORM"] = int(Opcode::kRmsNorm);
  ops["LINEAR"] = int(Opcode::kLinear);
  ops["QK_NORM"] = int(Opcode::kQkNorm);
  ops["ROPE"] = int(Opcode::kRope);
  ops["KV_APPEND"] = int(Opcode::kKvAppend);
  ops["ATTN_DECODE"] = int(Opcode::kAttnDecode);
  ops["SILU_MUL"] = int(Opcode::kSiluMul);
  ops["SAMPLE"] = int(Opcode::kSample);
  m.attr("SCHEDULE_OPCODES") = ops;
  m.attr("SCHEDULE_NUM_OPCODES") = int(Opcode::kNumOpcodes);
  py::dict bufs;
  bufs["TOKENS"] = int(Buffer::kTokens);
  bufs["HIDDEN"] = int(Buffer::kHidden);
  bufs["RESIDUAL"] = int(Buffer::kResidual);
  bufs["NORMED"] = int(Buffer::kNormed);
  bufs["QKV"] = int(Buffer::kQkv);
  bufs["ATTN"] = int(Buffer::kAttn);
  bufs["GATE_UP"] = int(Buffer::kGateUp);
  bufs["ACT"] = int(Buffer::kAct);
  bufs["LOGITS"] = int(Buffer::kLogits);
  m.attr("SCHEDULE_BUFFERS") = bufs;
  m.attr("SCHEDULE_NUM_BUFFERS") = int(Buffer::kNumBuffers);
}
