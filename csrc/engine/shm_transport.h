// Collectives between the tensor-parallel ranks of one host through one POSIX shared-memory
// segment: what the CPU decode executor calls for the program's lane ops (kog.parallel).
//
//   ShmTransport t(name, rank, size, reduce_floats, n_slots, slot_bytes, timeout_s);  // rank 0 creates
//   t.all_reduce(x, n);            // x[0..n) f32 = the sum over ranks, in rank order (bit-identical everywhere;
//                                  // n > reduce_floats: piece by piece)
//   t.publish(slot, part, bytes);  // a delayed all-gather: this rank's part of `slot`, returns at once
//                                  // (zero-copy when part is t.slot_part(slot): written there in place)
//   t.prefetch(slot);              // ahead of wait(slot): the other ranks' flags and parts into this cache
//   const char* all = t.wait(slot);  // [size][slot_bytes]: every rank's part of its last publish
//
// Protocol. All-reduce k (counted per rank) writes its input to reduce area k % 2, stores k in
// its flag (release) and spins until every flag is >= k (acquire), then sums the areas in rank
// order. Reuse is safe with two areas: a rank writes area k % 2 again at k + 2 only after every
// flag reached k + 1, and a rank raises its flag to k + 1 only after it finished reading k.
// A slot's publish writes the rank's part and raises the rank's epoch of that slot; wait()
// spins until every rank's epoch of the slot reached this rank's. NOTE (caller's invariant): a
// rank publishes a slot again only once every rank has waited on its previous contents. With
// the Laneformer program (publish layer j, then wait on layer j - D) a rank publishing layer j
// has waited on j - 1 - D, so every other rank published j - 1 - D and may still read layers
// >= j - 1 - 2D: a ring of 2 D + 2 slots per kind keeps them apart (kog.lane_config).
//
// Every spin is bounded: past timeout_s it throws kog::Error(kTransport) naming the rank that
// did not arrive; a rank whose process exited (its pid, kept in the segment, is gone) fails the
// spin within a millisecond instead. link_latency_us (simulation, bench/tp_decode.py) makes each
// flag visible to the readers only that long after its store (the sender goes on at once, as over
// a real link, so a reader that arrives later than that pays nothing);
// noop makes every collective local (this rank's data only; for measuring exposed
// communication, never for results).
#pragma once
#include <atomic>
#include <cstdint>
#include <string>

namespace kog::engine {

class ShmTransport {
 public:
  // Rank 0 creates (and later unlinks) the segment `name` ("/kog-..."); other ranks attach,
  // waiting up to timeout_s for it to exist. reduce_floats: the largest all-reduce; n_slots and
  // slot_bytes: the delayed-gather slots and one rank's part of one.
  ShmTransport(const std::string& name, int rank, int size, int64_t reduce_floats, int n_slots, int64_t slot_bytes,
               double timeout_s);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t slot_bytes() const { return slot_bytes_; }  // bytes between ranks' parts of a slot (wait())

  void all_reduce(float* x, int64_t n);
  void publish(int slot, const void* part, int64_t bytes);
  const char* wait(int slot);
  // This rank's part of `slot` ([slot_bytes]): a producer that writes its output here publishes
  // it without a copy (publish(slot, slot_part(slot), bytes)). Write it only between the wait
  // that freed the slot (the caller's invariant above) and the publish.
  char* slot_part(int slot) const;
  // Pulls the other ranks' flags and first `bytes` of their parts of `slot` toward this core, for
  // a wait(slot) some time later: a flag stored long ago then costs no cross-core miss inside the
  // wait. A hint only: lines written after it are fetched again.
  void prefetch(int slot, int64_t bytes) const;

  void set_link_latency_us(double us);
  void set_noop(bool noop) { noop_ = noop; }
  // Where this rank's communication time went since the last reset, per kind of collective.
  struct CommStats {
    int64_t count = 0;    // all-reduce pieces; delayed gathers (a publish and its wait count once)
    double inside_s = 0;  // inside the calls: copies, sums, waits. A rank computes nothing
                          // meanwhile, so this is the communication its step exposes
    double wait_s = 0;    // the part of inside_s spent spinning for other ranks' flags
    double link_s = 0;    // what the data took to travel, waited for or not: per all-reduce piece
                          // and per publish its copies (and sums) plus the simulated link
                          // latency; a wait adds nothing (its data travelled at the publish)
  };
  const CommStats& reduce_stats() const { return reduce_stats_; }  // all_reduce
  const CommStats& gather_stats() const { return gather_stats_; }  // publish + wait
  void reset_stats() { reduce_stats_ = gather_stats_ = CommStats{}; }

 private:
  struct alignas(64) Flag {
    std::atomic<uint64_t> v;
    std::atomic<uint64_t> visible;  // simulated link latency: readers wait until this tick (tick_clock)
  };
  // Spins until every flags[q] >= target (and visible); t0: tick_clock::now() at the call.
  // Returns the ticks spun (0 without a second clock read when all are ready at t0).
  uint64_t spin_until(Flag* flags, uint64_t target, const char* what, uint64_t t0);
  void raise(Flag& f, uint64_t value, uint64_t now);  // f = value, visible after the simulated latency from now
  // Rank q's flag and part of `slot` (no range check): slot_flags_[slot][q], slot_data_[slot][q].
  Flag* flag_of(int slot, int q) const { return slot_flags_ + size_t(slot) * size_t(size_) + size_t(q); }
  char* part_of(int slot, int q) const {
    return slot_data_ + (size_t(slot) * size_t(size_) + size_t(q)) * size_t(slot_bytes_);
  }

  std::string name_;
  int rank_, size_, n_slots_;
  int64_t reduce_floats_, slot_bytes_;
  double timeout_s_, latency_us_ = 0;
  // The same in tick_clock ticks, and this process's seconds per tick.
  uint64_t timeout_ticks_ = 0, latency_ticks_ = 0, ms_ticks_ = 0;
  double spt_ = 1e-9;
  CommStats reduce_stats_, gather_stats_;
  bool noop_ = false;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  Flag* reduce_flags_ = nullptr;  // [size]
  Flag* pids_ = nullptr;          // [size] each rank's process id (0: not attached yet)
  float* reduce_data_ = nullptr;  // [2][size][reduce_floats]
  Flag* slot_flags_ = nullptr;    // [n_slots][size]
  char* slot_data_ = nullptr;     // [n_slots][size][slot_bytes]
  uint64_t reduce_seq_ = 0;
  uint64_t* slot_epoch_ = nullptr;  // [n_slots] this rank's publishes per slot (private memory)
};

}  // namespace kog::engine
