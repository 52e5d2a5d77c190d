// Shared-memory collectives between tensor-parallel ranks. Contract: shm_transport.h.
#include "engine/shm_transport.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "common/errors.h"
#include "engine/tick_clock.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

namespace kog::engine {

namespace {

constexpr uint64_t kMagic = 0x6b6f672d74702d31ull;  // "kog-tp-1"

struct Header {
  std::atomic<uint64_t> magic;  // set last by the creator: the layout below is ready
  int32_t size;
  int32_t n_slots;
  int64_t reduce_floats;
  int64_t slot_bytes;
};

size_t round_up(size_t x) { return (x + 63) / 64 * 64; }

// A publish's copy into the segment with streaming stores where the target is 16-byte aligned:
// the lines go out without first being fetched from the reader's cache (where its last read of
// the slot left them), so the sender pays for the stores only; the fence orders them before the
// flag that announces them.
void publish_copy(char* dst, const char* src, size_t bytes) {
#if defined(__x86_64__) || defined(_M_X64)
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    size_t i = 0;
    for (; i + 16 <= bytes; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    std::memcpy(dst + i, src + i, bytes - i);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Whether process pid still runs: kill(pid, 0) finds a zombie too (a rank that exited but whose
// parent -- rank 0 spawned the others -- has not reaped it yet), so a found process is read from
// /proc (Linux) and one in state Z counts as exited.
bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0) return errno != ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: trust kill()
  char buf[256];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces
  return paren == nullptr || paren[1] != ' ' || paren[2] != 'Z';
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

ShmTransport::ShmTransport(const std::string& name, int rank, int size, int64_t reduce_floats, int n_slots,
                           int64_t slot_bytes, double timeout_s)
    : name_(name), rank_(rank), size_(size), n_slots_(n_slots), reduce_floats_(reduce_floats),
      slot_bytes_(round_up(size_t(slot_bytes))), timeout_s_(timeout_s) {
  KOG_CHECK(size >= 1 && rank >= 0 && rank < size, "shm transport: rank ", rank, " of ", size);
  KOG_CHECK(reduce_floats >= 0 && n_slots >= 0 && slot_bytes >= 0 && timeout_s > 0, "shm transport: bad sizes");
  KOG_CHECK(!name.empty() && name[0] == '/', "shm transport: the segment name must start with '/', got ", name);
  tick_clock::init();
  spt_ = tick_clock::seconds_per_tick();
  timeout_ticks_ = tick_clock::ticks(timeout_s);
  ms_ticks_ = tick_clock::ticks(1e-3);
  const size_t header = round_up(sizeof(Header));
  const size_t reduce_flags = round_up(sizeof(Flag) * size_t(size)) * 2;  // the flags, then the pids
  const size_t reduce_data = round_up(sizeof(float) * 2 * size_t(size) * size_t(reduce_floats));
  const size_t slot_flags = round_up(sizeof(Flag) * size_t(n_slots) * size_t(size));
  bytes_ = header + reduce_flags + reduce_data + slot_flags + size_t(n_slots) * size_t(size) * size_t(slot_bytes_);
  int fd = -1;
  if (rank == 0) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    KOG_CHECK_KIND(fd >= 0, kTransport, "shm transport: cannot create ", name, ": ", std::strerror(errno));
    if (ftruncate(fd, off_t(bytes_)) != 0) {
      close(fd);
      shm_unlink(name.c_str());
      KOG_CHECK_KIND(false, kTransport, "shm transport: cannot size ", name, " to ", bytes_, " bytes");
    }
  } else {  // the creator may not have run yet
    const double deadline = now_s() + timeout_s;
    while ((fd = shm_open(name.c_str(), O_RDWR, 0600)) < 0 && now_s() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    KOG_CHECK_KIND(fd >= 0, kTransport, "shm transport: rank ", rank, " found no segment ", name,
                   " within ", timeout_s, " s (rank 0 did not start)");
    struct stat st{};
    const double size_deadline = now_s() + timeout_s;
    while (fstat(fd, &st) == 0 && size_t(st.st_size) < bytes_ && now_s() < size_deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (size_t(st.st_size) < bytes_) close(fd);
    KOG_CHECK_KIND(size_t(st.st_size) >= bytes_, kTransport, "shm transport: segment ", name, " has ",
                   st.st_size, " bytes, this rank needs ", bytes_, " (ranks disagree on the sizes)");
  }
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  KOG_CHECK_KIND(p != MAP_FAILED, kTransport, "shm transport: cannot map ", name);
  base_ = static_cast<char*>(p);
  auto* h = reinterpret_cast<Header*>(base_);
  reduce_flags_ = reinterpret_cast<Flag*>(base_ + header);
  pids_ = reduce_flags_ + size;
  reduce_data_ = reinterpret_cast<float*>(base_ + header + reduce_flags);
  slot_flags_ = reinterpret_cast<Flag*>(base_ + header + reduce_flags + reduce_data);
  slot_data_ = base_ + header + reduce_flags + reduce_data + slot_flags;
  slot_epoch_ = new uint64_t[size_t(n_slots > 0 ? n_slots : 1)]();
  pids_[rank].v.store(uint64_t(getpid()), std::memory_order_release);
  if (rank == 0) {  // ftruncate zeroed the flags; publish the layout last
    h->size = size, h->n_slots = n_slots, h->reduce_floats = reduce_floats, h->slot_bytes = slot_bytes_;
    h->magic.store(kMagic, std::memory_order_release);
    return;
  }
  const double deadline = now_s() + timeout_s;
  while (h->magic.load(std::memory_order_acquire) != kMagic && now_s() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool same = h->magic.load(std::memory_order_acquire) == kMagic && h->size == size &&
                    h->n_slots == n_slots && h->reduce_floats == reduce_floats && h->slot_bytes == slot_bytes_;
  if (!same) {
    munmap(base_, bytes_);
    base_ = nullptr;
    KOG_CHECK_KIND(false, kTransport, "shm transport: segment ", name,
                   " was not initialized in time or its sizes differ from rank ", rank, "'s");
  }
}

ShmTransport::~ShmTransport() {
  delete[] slot_epoch_;
  if (base_ != nullptr) munmap(base_, bytes_);
  if (rank_ == 0) shm_unlink(name_.c_str());
}

void ShmTransport::set_link_latency_us(double us) {
  latency_us_ = us;
  latency_ticks_ = us > 0 ? tick_clock::ticks(us * 1e-6) : 0;
}

void ShmTransport::raise(Flag& f, uint64_t value, uint64_t now) {
  if (latency_ticks_ > 0) f.visible.store(now + latency_ticks_, std::memory_order_relaxed);
  f.v.store(value, std::memory_order_release);
}

uint64_t ShmTransport::spin_until(Flag* flags, uint64_t target, const char* what, uint64_t t0) {
  uint64_t t = t0;  // the latest clock read: the clock is read again only while a flag is not visible
  uint64_t last_check = t0;  // the last liveness check of the awaited rank's process
  for (int q = 0; q < size_; ++q) {
    uint64_t spins = 0;
    for (;;) {
      if (flags[q].v.load(std::memory_order_acquire) >= target) {
        if (latency_ticks_ == 0 || t >= flags[q].visible.load(std::memory_order_relaxed)) break;
        t = tick_clock::now();
        if (t >= flags[q].visible.load(std::memory_order_relaxed)) break;
      }
      if (++spins % 1024 == 0) {
        t = tick_clock::now();
        KOG_CHECK_KIND(t - t0 < timeout_ticks_, kTransport, "shm transport: rank ", rank_, " waited ",
                       timeout_s_, " s for rank ", q, " in ", what, " (it died or hangs)");
        if (t - last_check >= ms_ticks_) {  // at most every millisecond: the check reads /proc
          last_check = t;
          const auto pid = pid_t(pids_[q].v.load(std::memory_order_acquire));
          KOG_CHECK_KIND(pid == 0 || process_alive(pid), kTransport, "shm transport: rank ", q, " (process ", pid,
                         ") exited while rank ", rank_, " waited for it in ", what);
        }
        if (spins > (1u << 16)) std::this_thread::yield();  // a peer descheduled: give the core back
      }
    }
  }
  return t == t0 ? 0 : tick_clock::now() - t0;
}

void ShmTransport::all_reduce(float* x, int64_t n) {
  if (noop_ || size_ == 1) return;
  const uint64_t t_in = tick_clock::now();
  KOG_CHECK(n >= 0 && reduce_floats_ > 0, "shm transport: all_reduce of ", n, " floats, the segment holds ",
            reduce_floats_);
  // Longer than the reduce area: one collective per piece (every rank cuts the same pieces).
  for (int64_t off = 0; off < n; off += reduce_floats_) {
    const int64_t m = n - off < reduce_floats_ ? n - off : reduce_floats_;
    float* y = x + off;
    const uint64_t t_piece = tick_clock::now();
    const uint64_t k = ++reduce_seq_;
    float* area = reduce_data_ + (k % 2) * size_t(size_) * size_t(reduce_floats_);
    std::memcpy(area + size_t(rank_) * size_t(reduce_floats_), y, size_t(m) * sizeof(float));
    raise(reduce_flags_[rank_], k, t_piece);
    const uint64_t spun = spin_until(reduce_flags_, k, "all_reduce", tick_clock::now());
    for (int64_t i = 0; i < m; ++i) y[i] = area[i];
    for (int q = 1; q < size_; ++q) {
      const float* src = area + size_t(q) * size_t(reduce_floats_);
      for (int64_t i = 0; i < m; ++i) y[i] += src[i];
    }
    reduce_stats_.count += 1;
    reduce_stats_.wait_s += double(spun) * spt_;
    reduce_stats_.link_s += double(tick_clock::now() - t_piece - spun) * spt_ + latency_us_ * 1e-6;
  }
  reduce_stats_.inside_s += double(tick_clock::now() - t_in) * spt_;
}

char* ShmTransport::slot_part(int slot) const {
  KOG_CHECK(slot >= 0 && slot < n_slots_, "shm transport: slot ", slot, " of ", n_slots_);
  return part_of(slot, rank_);
}

void ShmTransport::prefetch(int slot, int64_t bytes) const {
  if (slot < 0 || slot >= n_slots_ || noop_) return;
  const int64_t n = bytes < slot_bytes_ ? bytes : slot_bytes_;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    __builtin_prefetch(flag_of(slot, q));
    const char* part = part_of(slot, q);
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(part + b);
  }
}

void ShmTransport::publish(int slot, const void* part, int64_t bytes) {
  KOG_CHECK(slot >= 0 && slot < n_slots_ && bytes <= slot_bytes_, "shm transport: publish of ", bytes,
            " bytes to slot ", slot, " (", n_slots_, " slots of ", slot_bytes_, " bytes)");
  const uint64_t t_in = tick_clock::now();
  char* dst = slot_part(slot);
  if (part != dst) {
    publish_copy(dst, static_cast<const char*>(part), size_t(bytes));
  } else {
    std::atomic_thread_fence(std::memory_order_release);  // written in place: the flag's release orders it
  }
  if (noop_) return;  // the epoch stays: a later real publish / wait pairs with the other ranks' again
  const uint64_t e = ++slot_epoch_[slot];
  raise(*flag_of(slot, rank_), e, t_in);
  const double took = double(tick_clock::now() - t_in) * spt_;
  gather_stats_.count += 1;
  gather_stats_.inside_s += took;
  gather_stats_.link_s += took + latency_us_ * 1e-6;
}

const char* ShmTransport::wait(int slot) {
  KOG_CHECK(slot >= 0 && slot < n_slots_, "shm transport: wait on slot ", slot, " of ", n_slots_);
  if (!noop_ && size_ > 1) {
    const uint64_t t_in = tick_clock::now();
    const uint64_t spun = spin_until(flag_of(slot, 0), slot_epoch_[slot], "wait", t_in);
    gather_stats_.wait_s += double(spun) * spt_;
    gather_stats_.inside_s += double(spun > 0 ? spun : tick_clock::now() - t_in) * spt_;
  }
  return part_of(slot, 0);
}

}  // namespace kog::engine
