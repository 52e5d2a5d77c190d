// Why a sequence stopped generating: the one vocabulary the native decode loop and the Python
// engine share (kog.engine.outputs.FinishReason mirrors it by name, checked by a test).
// kStop = 1 matches the GPU loop's `finished` flag (1 once a sequence sampled a stop id).
#pragma once
#include <cstdint>

namespace kog {

enum class FinishReason : int32_t {
  kNone = 0,    // still running
  kStop = 1,    // a stop token (EOS or a requested stop id) or a stop string
  kLength = 2,  // max_tokens or the context length reached
  kAbort = 3,   // aborted by the client (or the engine)
};

}  // namespace kog
