#include "sim.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define SPECDEC_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SPECDEC_SIM_ASAN 1
#endif
#endif

#ifdef SPECDEC_SIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// ----- context switch ----------------------------------------------------------------------------
// On x86-64 a fiber switch saves the callee-saved registers and the FP control words on the old stack and
// pops them from the new one: ~20 ns, against ~1 us for swapcontext, which also makes two system calls
// for the signal mask. Elsewhere swapcontext is used.
#if defined(__x86_64__) && defined(__linux__)
#define SPECDEC_SIM_FAST_SWITCH 1
extern "C" void specdec_sim_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl specdec_sim_switch
  .hidden specdec_sim_switch
  .type specdec_sim_switch, @function
specdec_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size specdec_sim_switch, .-specdec_sim_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace specdec::sim {
namespace {

constexpr int kWarpSize = 32;
#ifdef SPECDEC_SIM_ASAN
constexpr size_t kStackBytes = 512 * 1024;  // instrumented frames are several times larger
#else
constexpr size_t kStackBytes = 256 * 1024;
#endif

// kSpinning: yielded polling again in a spin loop (spin_wait); runnable, but its switch was no progress.
enum class FiberState : uint8_t { kRunnable, kAtBarrier, kAtCluster, kAtWarp, kSpinning, kDone, kFailed };

struct FiberStack {
  char* base = nullptr;  // guard page first, then kStackBytes of stack
  // A fiber abandoned on this stack (a failed launch) left its frames' AddressSanitizer redzones poisoned: cleared
  // before the stack runs another fiber, which would otherwise be reported writing into them.
  bool abandoned = false;
  FiberStack() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw SimError("specdec sim: cannot map a fiber stack");
    mprotect(p, page, PROT_NONE);  // a stack overflow faults instead of corrupting a neighbour
    base = static_cast<char*>(p) + page;
  }
  ~FiberStack() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    munmap(base - page, kStackBytes + page);
  }
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;
};

struct Fiber {
#ifdef SPECDEC_SIM_FAST_SWITCH
  void* sp = nullptr;  // saved stack pointer while suspended
#else
  ucontext_t ctx;
#endif
  FiberState state = FiberState::kRunnable;
  uint3 tid{};
  unsigned linear = 0;  // index within its block
  unsigned rank = 0;    // its block's index among the blocks run together (its cluster's rank in a cluster)
  unsigned slot = 0;    // index among the fibers of the running cluster (and of its stack)
  // The pending warp collective (valid in kAtWarp).
  WarpOp op = WarpOp::kSync;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 0;
  uint64_t result = 0;
  const char* file = "";
  unsigned line = 0;
  void* asan_fake_stack = nullptr;
};

struct SharedAlloc {
  void* ptr;
  size_t bytes;
};

// A running block: its identity and its shared memory.
struct Block {
  uint3 id{};
  uint64_t serial = 0;
  std::unordered_map<const void*, SharedAlloc> static_shared;
  size_t static_shared_bytes = 0;
  void* dynamic_shared = nullptr;
};

struct Launch {
  const char* name = "";
  dim3 grid, block, cluster;
  const std::function<void()>* body = nullptr;
  unsigned nthreads = 0;         // per block
  unsigned cluster_blocks = 1;   // blocks per cluster
  unsigned group_blocks = 1;     // blocks run together: a cluster's, or a cooperative launch's grid
  bool cooperative = false;
  std::vector<Block> blocks;     // the running group's, by rank
  std::vector<Fiber> fibers;     // block rank r's thread i is fibers[r * nthreads + i]
  Fiber* current = nullptr;
#ifdef SPECDEC_SIM_FAST_SWITCH
  void* scheduler_sp = nullptr;
#else
  ucontext_t scheduler;
#endif
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
  size_t dynamic_shared_bytes = 0;
  bool failed = false;
  std::string error;
  LaunchStats stats;

  Block& block_of(const Fiber& f) { return blocks[f.rank]; }
};

thread_local Launch* tls_launch = nullptr;
thread_local uint64_t tls_blocks_run = 0;  // numbers the blocks run on this thread, across launches
thread_local LaunchStats tls_last_stats;
thread_local std::vector<std::unique_ptr<FiberStack>> tls_stacks;  // reused across launches

Launch& active(const char* what) {
  if (tls_launch == nullptr || tls_launch->current == nullptr) {
    throw SimError(std::string("specdec sim: ") + what + " called outside a kernel launch");
  }
  return *tls_launch;
}

// --- context switches, annotated for AddressSanitizer (it must know which stack is live) ----------

void raw_switch_to_fiber(Launch& L, Fiber& f) {
#ifdef SPECDEC_SIM_FAST_SWITCH
  specdec_sim_switch(&L.scheduler_sp, f.sp);
#else
  swapcontext(&L.scheduler, &f.ctx);
#endif
}

void raw_switch_to_scheduler(Launch& L, Fiber& f) {
#ifdef SPECDEC_SIM_FAST_SWITCH
  specdec_sim_switch(&f.sp, L.scheduler_sp);
#else
  swapcontext(&f.ctx, &L.scheduler);
#endif
}

void switch_to_fiber(Launch& L, Fiber& f) {
  L.current = &f;
  ++L.stats.switches;
#ifdef SPECDEC_SIM_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, tls_stacks[f.slot]->base, kStackBytes);
  raw_switch_to_fiber(L, f);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  raw_switch_to_fiber(L, f);
#endif
  L.current = nullptr;
}

// Called on the fiber's stack. `exiting` fibers are never resumed.
void switch_to_scheduler(Launch& L, Fiber& f, bool exiting) {
#ifdef SPECDEC_SIM_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.asan_fake_stack, L.scheduler_stack_bottom,
                                 L.scheduler_stack_size);
  raw_switch_to_scheduler(L, f);
  __sanitizer_finish_switch_fiber(f.asan_fake_stack, nullptr, nullptr);
#else
  (void)exiting;
  raw_switch_to_scheduler(L, f);
#endif
}

void fiber_entry() {
  Launch& L = *tls_launch;
  Fiber& f = *L.current;
#ifdef SPECDEC_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &L.scheduler_stack_bottom, &L.scheduler_stack_size);
#endif
  (*L.body)();
  f.state = FiberState::kDone;
  switch_to_scheduler(L, f, /*exiting=*/true);
  std::abort();  // a finished fiber is never resumed
}

std::string where(const Launch& L, unsigned rank) {
  const uint3 id = L.blocks[rank].id;
  std::ostringstream s;
  s << "kernel " << L.name << ", block (" << id.x << "," << id.y << "," << id.z << ")";
  return s.str();
}

std::string thread_name(const Fiber& f) {
  std::ostringstream s;
  s << "thread (" << f.tid.x << "," << f.tid.y << "," << f.tid.z << ")";
  return s.str();
}

// Records the launch's first error. Callers build messages in a scope that ends before abandon():
// an abandoned fiber's stack is never unwound, so anything it owns would leak.
void record_failure(Launch& L, const std::string& message) {
  if (!L.failed) {
    L.failed = true;
    L.error = "specdec sim: " + where(L, L.current->rank) + ", " + thread_name(*L.current) + ": " + message;
  }
}

// Records a failure found by the scheduler (no fiber running) in block `rank`.
void record_block_failure(Launch& L, unsigned rank, const std::string& message) {
  if (!L.failed) {
    L.failed = true;
    L.error = "specdec sim: " + where(L, rank) + ": " + message;
  }
}

[[noreturn]] void abandon(Launch& L) {
  Fiber& f = *L.current;
  f.state = FiberState::kFailed;
  switch_to_scheduler(L, f, /*exiting=*/true);
  std::abort();
}

void yield(Launch& L, Fiber& f) { switch_to_scheduler(L, f, /*exiting=*/false); }

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kSync: return "__syncwarp";
    case WarpOp::kShflIdx: return "__shfl_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kBallot: return "__ballot_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kAll: return "__all_sync";
  }
  return "?";
}

// Lane that lane `lane` reads in a shuffle, or `lane` itself where CUDA returns the caller's own value.
int shuffle_source(const Fiber& f, int lane) {
  const int w = f.width;
  const int segment = lane / w * w;
  switch (f.op) {
    case WarpOp::kShflIdx: return segment + (((f.arg % w) + w) % w);
    case WarpOp::kShflUp: return (lane - segment) >= f.arg ? lane - f.arg : lane;
    case WarpOp::kShflDown: return (lane - segment) + f.arg < w ? lane + f.arg : lane;
    case WarpOp::kShflXor: {
      const int src = lane ^ f.arg;
      return src >= segment + w || src >= kWarpSize ? lane : src;  // later groups: own value
    }
    default: return lane;
  }
}

// Completes every warp collective of block `rank` whose lanes have all arrived. Returns whether any completed.
bool release_warp_collectives(Launch& L, unsigned rank) {
  bool released = false;
  const unsigned nwarps = (L.nthreads + kWarpSize - 1) / kWarpSize;
  for (unsigned w = 0; w < nwarps; ++w) {
    const unsigned first = rank * L.nthreads + w * kWarpSize;
    const unsigned lanes = std::min<unsigned>(kWarpSize, L.nthreads - w * kWarpSize);
    for (unsigned l = 0; l < lanes; ++l) {
      Fiber& leader = L.fibers[first + l];
      if (leader.state != FiberState::kAtWarp) continue;
      const unsigned mask = leader.mask;
      bool ready = true;
      for (unsigned j = 0; j < kWarpSize && ready; ++j) {
        if (!(mask >> j & 1u)) continue;
        if (j >= lanes) {
          std::ostringstream s;
          s << op_name(leader.op) << " at " << leader.file << ":" << leader.line << " has mask 0x" << std::hex << mask
            << std::dec << " naming lane " << j << " of warp " << w << ", which does not exist in a block of "
            << L.nthreads << " threads";
          record_block_failure(L, rank, s.str());
          return false;
        }
        const Fiber& g = L.fibers[first + j];
        if (g.state == FiberState::kDone) {
          record_block_failure(L, rank, std::string(op_name(leader.op)) + " at " + leader.file + ":" +
                                            std::to_string(leader.line) + " waits for lane " + std::to_string(j) +
                                            " of warp " + std::to_string(w) + ", which has exited");
          return false;
        }
        if (g.state != FiberState::kAtWarp) {
          ready = false;
        } else if (g.op != leader.op || g.mask != mask || g.width != leader.width) {
          std::ostringstream s;
          s << "warp collective mismatch in warp " << w << ": lane " << l
            << " calls " << op_name(leader.op) << "(mask 0x" << std::hex << mask << std::dec << ") at "
            << leader.file << ":" << leader.line << ", lane " << j << " calls " << op_name(g.op)
            << "(mask 0x" << std::hex << g.mask << std::dec << ") at " << g.file << ":" << g.line;
          record_block_failure(L, rank, s.str());
          return false;
        }
      }
      if (!ready) continue;
      // Every lane of `mask` has arrived with the same op: compute each lane's result.
      uint32_t votes = 0;
      for (unsigned j = 0; j < kWarpSize; ++j) {
        if ((mask >> j & 1u) && L.fibers[first + j].value != 0) votes |= 1u << j;
      }
      for (unsigned j = 0; j < kWarpSize; ++j) {
        if (!(mask >> j & 1u)) continue;
        Fiber& g = L.fibers[first + j];
        switch (g.op) {
          case WarpOp::kSync: g.result = 0; break;
          case WarpOp::kBallot: g.result = votes; break;
          case WarpOp::kAny: g.result = votes != 0; break;
          case WarpOp::kAll: g.result = votes == mask; break;
          default: {
            const int src = shuffle_source(g, static_cast<int>(j));
            if (!(mask >> src & 1u)) {
              record_block_failure(L, rank, std::string(op_name(g.op)) + " at " + g.file + ":" +
                                                std::to_string(g.line) + ": lane " + std::to_string(j) +
                                                " reads lane " + std::to_string(src) + ", which is not in the mask");
              return false;
            }
            g.result = L.fibers[first + src].value;
          }
        }
        g.state = FiberState::kRunnable;
      }
      released = true;
    }
  }
  return released;
}

// The states of fibers [first, first + count), for a barrier or deadlock message.
std::string describe_states(const Launch& L, unsigned first, unsigned count) {
  std::ostringstream s;
  unsigned at_barrier = 0, at_cluster = 0, at_warp = 0, done = 0;
  const Fiber* barrier_example = nullptr;
  const Fiber* cluster_example = nullptr;
  const Fiber* warp_example = nullptr;
  const Fiber* done_example = nullptr;
  for (unsigned i = first; i < first + count; ++i) {
    const Fiber& f = L.fibers[i];
    if (f.state == FiberState::kAtBarrier) {
      ++at_barrier;
      if (!barrier_example) barrier_example = &f;
    } else if (f.state == FiberState::kAtCluster) {
      ++at_cluster;
      if (!cluster_example) cluster_example = &f;
    } else if (f.state == FiberState::kAtWarp) {
      ++at_warp;
      if (!warp_example) warp_example = &f;
    } else if (f.state == FiberState::kDone) {
      ++done;
      if (!done_example) done_example = &f;
    }
  }
  s << at_barrier << " of " << count << " threads wait at __syncthreads";
  if (barrier_example) s << " (e.g. " << thread_name(*barrier_example) << " at " << barrier_example->file << ":" << barrier_example->line << ")";
  if (at_cluster > 0) {
    s << ", " << at_cluster << " at cluster.sync() (e.g. block rank " << cluster_example->rank << " "
      << thread_name(*cluster_example) << " at " << cluster_example->file << ":" << cluster_example->line << ")";
  }
  s << ", " << at_warp << " at a warp collective";
  if (warp_example) s << " (e.g. " << thread_name(*warp_example) << " in " << op_name(warp_example->op) << " at " << warp_example->file << ":" << warp_example->line << ")";
  unsigned spinning = 0;
  for (unsigned i = first; i < first + count; ++i) spinning += L.fibers[i].state == FiberState::kRunnable;
  if (spinning > 0) s << ", " << spinning << " spin on memory no other thread writes";
  s << ", " << done << " have exited";
  if (done_example) s << " (e.g. " << thread_name(*done_example) << ")";
  return s.str();
}

void free_shared(Launch& L) {
  for (Block& b : L.blocks) {
    for (auto& [site, alloc] : b.static_shared) std::free(alloc.ptr);
    b.static_shared.clear();
    b.static_shared_bytes = 0;
    std::free(b.dynamic_shared);
    b.dynamic_shared = nullptr;
  }
}

bool block_exited(const Launch& L, unsigned rank) {
  for (unsigned i = 0; i < L.nthreads; ++i) {
    if (L.fibers[rank * L.nthreads + i].state != FiberState::kDone) return false;
  }
  return true;
}

// Runs the blocks of cluster number `cluster_index` (L.blocks, ids set) to completion or to the first error.
void run_cluster(Launch& L, uint64_t cluster_index) {
  free_shared(L);
  for (Block& b : L.blocks) {
    if (L.dynamic_shared_bytes > 0) {
      b.dynamic_shared = std::malloc(L.dynamic_shared_bytes);
      std::memset(b.dynamic_shared, 0xFF, L.dynamic_shared_bytes);
    }
  }
  const unsigned total = L.nthreads * L.group_blocks;
  for (unsigned slot = 0; slot < total; ++slot) {
#ifdef SPECDEC_SIM_ASAN
    if (tls_stacks[slot]->abandoned) {
      __asan_unpoison_memory_region(tls_stacks[slot]->base, kStackBytes);
      tls_stacks[slot]->abandoned = false;
    }
#endif
    Fiber& f = L.fibers[slot];
    const unsigned i = slot % L.nthreads;
    f = Fiber{};
    f.linear = i;
    f.rank = slot / L.nthreads;
    f.slot = slot;
    f.tid = uint3{i % L.block.x, i / L.block.x % L.block.y, i / (L.block.x * L.block.y)};
#ifdef SPECDEC_SIM_FAST_SWITCH
    // The frame specdec_sim_switch pops on the first switch: FP control words, six callee-saved registers,
    // then fiber_entry as the return address, above it a null "return address" of fiber_entry itself, so
    // that fiber_entry starts with the stack alignment of a call.
    uint64_t* top = reinterpret_cast<uint64_t*>(tls_stacks[slot]->base + kStackBytes);
    *--top = 0;
    *--top = reinterpret_cast<uint64_t>(&fiber_entry);
    for (int r = 0; r < 6; ++r) *--top = 0;
    *--top = 0x037F00001F80ull;  // MXCSR 0x1F80 (all exceptions masked, round to nearest), x87 CW 0x037F
    f.sp = top;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = tls_stacks[slot]->base;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
#endif
  }
  // Each block runs as far as it can (to the cluster barrier, or to its end) before the next one starts, in
  // rank order or in reverse, alternating at each cluster barrier and between clusters. A legal schedule, and
  // an adversarial one for distributed shared memory: a block that runs ahead overwrites its shared memory
  // before a slower block reads it unless a cluster barrier orders the two.
  uint64_t phase = cluster_index;
  for (;;) {
    const bool reverse = phase % 2 == 1;
    bool progress = false;
    for (unsigned k = 0; k < L.group_blocks; ++k) {
      const unsigned rank = reverse ? L.group_blocks - 1 - k : k;
      const unsigned first = rank * L.nthreads;
      for (;;) {
        for (unsigned i = first; i < first + L.nthreads; ++i) {
          if (L.fibers[i].state != FiberState::kRunnable) continue;
          switch_to_fiber(L, L.fibers[i]);
          if (L.fibers[i].state == FiberState::kSpinning) {
            L.fibers[i].state = FiberState::kRunnable;  // polled and found nothing new: no progress
          } else {
            progress = true;
          }
          if (L.failed) return;
        }
        if (release_warp_collectives(L, rank)) continue;
        if (L.failed) return;
        unsigned block_done = 0, at_barrier = 0;
        for (unsigned i = first; i < first + L.nthreads; ++i) {
          block_done += L.fibers[i].state == FiberState::kDone;
          at_barrier += L.fibers[i].state == FiberState::kAtBarrier;
        }
        if (at_barrier == 0 || at_barrier + block_done < L.nthreads) break;  // done, or waiting for the cluster
        if (block_done > 0) {
          record_block_failure(L, rank, "barrier divergence: " + describe_states(L, first, L.nthreads));
          return;
        }
        for (unsigned i = first; i < first + L.nthreads; ++i) L.fibers[i].state = FiberState::kRunnable;
      }
    }
    unsigned done = 0, at_cluster = 0;
    for (const Fiber& f : L.fibers) {
      done += f.state == FiberState::kDone;
      at_cluster += f.state == FiberState::kAtCluster;
    }
    if (done == total) return;
    if (at_cluster > 0 && at_cluster + done == total) {
      if (done > 0) {
        const auto exited = std::find_if(L.fibers.begin(), L.fibers.end(),
                                         [](const Fiber& f) { return f.state == FiberState::kDone; });
        record_block_failure(L, exited->rank, "cluster barrier divergence, this block's " + thread_name(*exited) +
                                                  " has exited: " + describe_states(L, 0, total));
        return;
      }
      for (Fiber& f : L.fibers) f.state = FiberState::kRunnable;
      ++phase;
      continue;
    }
    if (progress) {
      if (L.cooperative) ++phase;  // the blocks of a cooperative launch alternate their order at every round
      continue;
    }
    record_block_failure(L, 0, "deadlock: " + describe_states(L, 0, total));
    return;
  }
}

}  // namespace

const DeviceLimits& device_limits() {
  static const DeviceLimits limits;
  return limits;
}

unsigned resident_blocks(unsigned threads_per_block) {
  const DeviceLimits& lim = device_limits();
  const unsigned per_sm = threads_per_block == 0 ? 0 : lim.max_threads_per_multiprocessor / threads_per_block;
  return lim.multiprocessors * std::min(per_sm, lim.max_blocks_per_multiprocessor);
}

void launch(const char* kernel_name, dim3 grid, dim3 block, dim3 cluster, size_t dynamic_shared_bytes,
            const std::function<void()>& body, bool cooperative) {
  const DeviceLimits& lim = device_limits();
  auto reject = [&](const std::string& why) {
    throw SimError(std::string("specdec sim: launch of ") + kernel_name + " rejected (invalid configuration): " + why);
  };
  const unsigned bd[3] = {block.x, block.y, block.z};
  const unsigned gd[3] = {grid.x, grid.y, grid.z};
  const unsigned cd[3] = {cluster.x, cluster.y, cluster.z};
  for (int i = 0; i < 3; ++i) {
    const std::string axis(1, "xyz"[i]);
    if (bd[i] == 0 || bd[i] > lim.max_block_dim[i]) reject("blockDim." + axis + " = " + std::to_string(bd[i]));
    if (gd[i] == 0 || gd[i] > lim.max_grid_dim[i]) reject("gridDim." + axis + " = " + std::to_string(gd[i]));
    if (cd[i] == 0 || gd[i] % cd[i] != 0) {
      reject("gridDim." + axis + " = " + std::to_string(gd[i]) + " is not a multiple of the cluster's " + std::to_string(cd[i]));
    }
  }
  const uint64_t nthreads = uint64_t{block.x} * block.y * block.z;
  if (nthreads > lim.max_threads_per_block) {
    reject(std::to_string(nthreads) + " threads per block, the device allows " + std::to_string(lim.max_threads_per_block));
  }
  const uint64_t cluster_blocks = uint64_t{cluster.x} * cluster.y * cluster.z;
  if (cluster_blocks > lim.max_cluster_blocks) {
    reject(std::to_string(cluster_blocks) + " blocks per cluster, the portable limit is " + std::to_string(lim.max_cluster_blocks));
  }
  if (dynamic_shared_bytes > lim.max_shared_optin) {
    reject(std::to_string(dynamic_shared_bytes) + " bytes of dynamic shared memory, the device allows " +
           std::to_string(lim.max_shared_optin));
  }
  const uint64_t grid_blocks = uint64_t{grid.x} * grid.y * grid.z;
  if (cooperative && cluster_blocks != 1) reject("a cooperative launch with clusters");
  if (cooperative && grid_blocks > resident_blocks(static_cast<unsigned>(nthreads))) {
    reject("a cooperative launch of " + std::to_string(grid_blocks) + " blocks of " + std::to_string(nthreads) +
           " threads, the device holds " + std::to_string(resident_blocks(static_cast<unsigned>(nthreads))) + " at once");
  }
  if (tls_launch != nullptr) throw SimError("specdec sim: a kernel launched another kernel (dynamic parallelism is not emulated)");

  Launch L;
  L.name = kernel_name;
  L.grid = grid;
  L.block = block;
  L.cluster = cluster;
  L.body = &body;
  L.nthreads = static_cast<unsigned>(nthreads);
  L.cluster_blocks = static_cast<unsigned>(cluster_blocks);
  L.group_blocks = cooperative ? static_cast<unsigned>(grid_blocks) : L.cluster_blocks;
  L.cooperative = cooperative;
  L.dynamic_shared_bytes = dynamic_shared_bytes;
  L.stats.threads_per_block = L.nthreads;
  L.stats.cluster_blocks = L.cluster_blocks;
  L.stats.cooperative = cooperative;
  L.blocks.resize(L.group_blocks);
  L.fibers.resize(L.nthreads * L.group_blocks);
  while (tls_stacks.size() < L.fibers.size()) tls_stacks.push_back(std::make_unique<FiberStack>());

  tls_launch = &L;
  struct Reset {
    Launch& L;
    ~Reset() {
      free_shared(L);
      tls_last_stats = L.stats;
      tls_launch = nullptr;
    }
  } reset{L};
  // A failed launch abandons the fibers that had not finished, on their stacks (FiberStack::abandoned).
  struct MarkAbandoned {
    Launch& L;
    ~MarkAbandoned() {
      if (!L.failed) return;
      for (const Fiber& f : L.fibers) {
        if (f.state != FiberState::kDone) tls_stacks[f.slot]->abandoned = true;
      }
    }
  } mark{L};
  if (cooperative) {  // one group: every block of the grid, x fastest
    for (unsigned i = 0; i < L.group_blocks; ++i) {
      Block& b = L.blocks[i];
      b.id = uint3{i % grid.x, i / grid.x % grid.y, i / (grid.x * grid.y)};
      b.serial = ++tls_blocks_run;
    }
    run_cluster(L, 0);
    L.stats.blocks = L.group_blocks;
    if (L.failed) throw SimError(L.error);
    return;
  }
  for (unsigned z = 0; z < grid.z; z += cluster.z) {
    for (unsigned y = 0; y < grid.y; y += cluster.y) {
      for (unsigned x = 0; x < grid.x; x += cluster.x) {
        // CUDA's block rank within a cluster: x fastest, then y, then z.
        for (unsigned rank = 0; rank < L.group_blocks; ++rank) {
          Block& b = L.blocks[rank];
          b.id = uint3{x + rank % cluster.x, y + rank / cluster.x % cluster.y, z + rank / (cluster.x * cluster.y)};
          b.serial = ++tls_blocks_run;
        }
        run_cluster(L, L.stats.blocks / L.cluster_blocks);
        L.stats.blocks += L.cluster_blocks;
        if (L.failed) throw SimError(L.error);
      }
    }
  }
}

const uint3& thread_idx() { return active("threadIdx").current->tid; }
const uint3& block_idx() {
  Launch& L = active("blockIdx");
  return L.block_of(*L.current).id;
}
const dim3& block_dim() { return active("blockDim").block; }
const dim3& grid_dim() { return active("gridDim").grid; }
uint64_t block_serial() {
  Launch& L = active("block_serial");
  return L.block_of(*L.current).serial;
}
unsigned cluster_block_rank() {
  Launch& L = active("cluster.block_rank()");
  return L.current->rank % L.cluster_blocks;
}
unsigned cluster_num_blocks() { return active("cluster.num_blocks()").cluster_blocks; }

namespace {
// Suspends the calling fiber at a block (kAtBarrier) or cluster (kAtCluster) barrier.
void wait_at_barrier(const char* what, FiberState barrier, const char* file, unsigned line) {
  Launch& L = active(what);
  Fiber& f = *L.current;
  f.state = barrier;
  f.file = file;
  f.line = line;
  yield(L, f);
}
}  // namespace

void sync_block(const char* file, unsigned line) { wait_at_barrier("__syncthreads", FiberState::kAtBarrier, file, line); }
void sync_cluster(const char* file, unsigned line) {
  // A cluster of one block (every block of a cooperative launch) synchronises as a block.
  const bool alone = active("cluster.sync()").cluster_blocks == 1;
  wait_at_barrier("cluster.sync()", alone ? FiberState::kAtBarrier : FiberState::kAtCluster, file, line);
}

void spin_wait(const char* file, unsigned line, bool again) {
  Launch& L = active("a spin loop");
  Fiber& f = *L.current;
  f.state = again ? FiberState::kSpinning : FiberState::kRunnable;  // a first poll follows work: progress
  f.file = file;
  f.line = line;
  yield(L, f);
}

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width, const char* file,
                         unsigned line) {
  Launch& L = active(op_name(op));
  Fiber& f = *L.current;
  const unsigned lane = f.linear % kWarpSize;
  if (!(mask >> lane & 1u)) {
    record_failure(L, std::string(op_name(op)) + " at " + file + ":" + std::to_string(line) + " called by lane " +
                          std::to_string(lane) + ", which is not in its mask");
    abandon(L);
  }
  if (width < 1 || width > kWarpSize || (width & (width - 1)) != 0) {
    record_failure(L, std::string(op_name(op)) + " at " + file + ":" + std::to_string(line) + ": width " +
                          std::to_string(width) + " is not a power of two in [1, 32]");
    abandon(L);
  }
  f.state = FiberState::kAtWarp;
  f.op = op;
  f.mask = mask;
  f.value = value;
  f.arg = arg;
  f.width = width;
  f.file = file;
  f.line = line;
  yield(L, f);
  return f.result;
}

void* static_shared(const void* site, size_t bytes, size_t align) {
  Launch& L = active("__shared__");
  Block& B = L.block_of(*L.current);
  auto it = B.static_shared.find(site);
  if (it != B.static_shared.end()) return it->second.ptr;
  const DeviceLimits& lim = device_limits();
  if (B.static_shared_bytes + bytes > lim.max_static_shared) {
    record_failure(L, "static __shared__ memory of " + std::to_string(B.static_shared_bytes + bytes) +
                          " bytes exceeds the device's " + std::to_string(lim.max_static_shared));
    abandon(L);
  }
  if (B.static_shared_bytes + bytes + L.dynamic_shared_bytes > lim.max_shared_optin) {
    record_failure(L, "static plus dynamic shared memory exceeds the device's " + std::to_string(lim.max_shared_optin) +
                          " bytes");
    abandon(L);
  }
  // A separate heap block per variable, so AddressSanitizer sees overruns between them.
  void* p = nullptr;
  if (posix_memalign(&p, std::max<size_t>(align, 16), std::max<size_t>(bytes, 1)) != 0) {
    record_failure(L, "cannot allocate " + std::to_string(bytes) + " bytes of emulated shared memory");
    abandon(L);
  }
  std::memset(p, 0xFF, bytes);
  B.static_shared.emplace(site, SharedAlloc{p, bytes});
  B.static_shared_bytes += bytes;
  return p;
}

void* dynamic_shared() {
  Launch& L = active("extern __shared__");
  return L.block_of(*L.current).dynamic_shared;
}

// " at file:line", for messages built in the full expression that records them (see record_failure).
std::string call_site(const char* file, unsigned line) { return std::string(" at ") + file + ":" + std::to_string(line); }

void* map_shared_rank(const void* p, unsigned rank, const char* file, unsigned line) {
  Launch& L = active("cluster.map_shared_rank()");
  if (rank >= L.cluster_blocks) {
    record_failure(L, "cluster.map_shared_rank" + call_site(file, line) + ": rank " + std::to_string(rank) + " of a cluster of " +
                          std::to_string(L.cluster_blocks) + " blocks");
    abandon(L);
  }
  const unsigned index = L.current->rank / L.cluster_blocks * L.cluster_blocks + rank;  // among the blocks run together
  if (block_exited(L, index)) {
    record_failure(L, "cluster.map_shared_rank" + call_site(file, line) + ": block rank " + std::to_string(rank) +
                          " has exited, and its shared memory with it");
    abandon(L);
  }
  const Block& mine = L.block_of(*L.current);
  const Block& other = L.blocks[index];
  const auto* q = static_cast<const char*>(p);
  if (mine.dynamic_shared != nullptr && q >= static_cast<const char*>(mine.dynamic_shared) &&
      q < static_cast<const char*>(mine.dynamic_shared) + L.dynamic_shared_bytes) {
    return static_cast<char*>(other.dynamic_shared) + (q - static_cast<const char*>(mine.dynamic_shared));
  }
  for (const auto& [site, alloc] : mine.static_shared) {
    const auto* base = static_cast<const char*>(alloc.ptr);
    if (q < base || q >= base + alloc.bytes) continue;
    const auto it = other.static_shared.find(site);
    if (it == other.static_shared.end()) {
      record_failure(L, "cluster.map_shared_rank" + call_site(file, line) + ": block rank " + std::to_string(rank) +
                            " has not declared this __shared__ variable yet (a cluster.sync() before remote accesses "
                            "guarantees it)");
      abandon(L);
    }
    return static_cast<char*>(it->second.ptr) + (q - base);
  }
  record_failure(L, "cluster.map_shared_rank" + call_site(file, line) + ": the pointer is not in this block's shared memory");
  abandon(L);
}

void fail(const char* message, const char* file, unsigned line) {
  Launch& L = active("a device-side check");
  record_failure(L, std::string(message) + " at " + file + ":" + std::to_string(line));
  abandon(L);
}

LaunchStats last_launch_stats() { return tls_last_stats; }

}  // namespace specdec::sim
