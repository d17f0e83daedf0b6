// The SIMT emulator: runs the CUDA kernels of csrc/kernels on the CPU (docs/design.md §7).
//
// Execution model: each CUDA thread of a block is a fiber; a fiber runs until it reaches a block or
// cluster barrier or a warp collective, spins on memory (spin_wait), or returns. Thread block clusters
// (sm_90) run one after another on the calling OS thread, the blocks of a cluster together (a launch without
// clusters has clusters of one block), so atomics are plain read-modify-writes. A cooperative launch runs
// every block of its grid together (the device must hold them all at once, as cudaLaunchCooperativeKernel
// requires), so blocks may wait for each other through global memory. Within a cluster each block runs as far as it can
// before the next starts (rank order or reverse, alternating at each cluster barrier), so a read of another
// block's shared memory that no cluster barrier orders sees that block's later writes. A barrier that not every live thread of the block
// (or cluster) reaches, a warp collective whose mask names a lane that does not take part, and a launch
// the device would reject all end the launch with SimError instead of hanging or silently continuing.
//
// Kernels never include this header directly: they use csrc/include/specdec/device.cuh, which maps
// each helper to CUDA or to the functions below.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

// CUDA's vector types, for host builds that do not see the CUDA headers.
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

namespace specdec::sim {

class SimError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The limits a launch is checked against: those of sm_80..sm_90 devices.
struct DeviceLimits {
  unsigned max_threads_per_block = 1024;
  unsigned max_block_dim[3] = {1024, 1024, 64};
  unsigned max_grid_dim[3] = {2147483647u, 65535u, 65535u};
  size_t max_static_shared = 48 * 1024;
  size_t max_shared_optin = 227 * 1024;  // sm_90; the launch helper opts in above 48 KiB
  unsigned max_cluster_blocks = 8;        // the portable cluster size
  // A small device, so that tests' modest shapes already take the multi-block paths. Residency (what a
  // cooperative launch may hold at once): multiprocessors x min(max_blocks_per_multiprocessor,
  // max_threads_per_multiprocessor / threads per block).
  unsigned multiprocessors = 4;
  unsigned max_threads_per_multiprocessor = 1024;
  unsigned max_blocks_per_multiprocessor = 32;
};
const DeviceLimits& device_limits();

struct Stream {};  // launches are synchronous

// Runs `body` once per thread of every block of `grid`, in clusters of `cluster` blocks (each dimension
// of the grid a multiple of the cluster's); returns when all blocks are done. `cooperative`: every block of
// the grid runs together (no clusters; at most resident_blocks(block) blocks).
// Throws SimError on an invalid configuration or on an error raised inside the kernel.
void launch(const char* kernel_name, dim3 grid, dim3 block, dim3 cluster, size_t dynamic_shared_bytes,
            const std::function<void()>& body, bool cooperative = false);
// How many blocks of `threads_per_block` threads the emulated device holds at once (DeviceLimits).
unsigned resident_blocks(unsigned threads_per_block);

// Built-in variables of the calling fiber.
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
// A number that identifies the running block among all blocks run on this OS thread (for per-block state
// of the emulated primitives).
uint64_t block_serial();

// __syncthreads: `file`/`line` name the call site in error messages.
void sync_block(const char* file, unsigned line);

// Thread block clusters: the calling block's rank in its cluster and the cluster's size in blocks;
// cluster.sync() (every thread of every block of the cluster); and cluster.map_shared_rank, the address of
// the same shared-memory byte in block `rank` of the cluster. `p` must point into the caller's shared
// memory, and the other block must have declared that variable (on a GPU: be running, which the cluster
// barrier before a remote access guarantees).
unsigned cluster_block_rank();
unsigned cluster_num_blocks();
void sync_cluster(const char* file, unsigned line);
void* map_shared_rank(const void* p, unsigned rank, const char* file, unsigned line);

// The calling thread polls memory another block writes (a spin loop's body): it yields so that the other
// blocks of a cooperative launch run. `again`: the poll before it, with nothing done since, found nothing either.
// A round in which every running thread only polls again is a deadlock (SimError).
void spin_wait(const char* file, unsigned line, bool again);

enum class WarpOp : uint8_t { kSync, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll };
// One warp collective: every lane named in `mask` must call it with the same op, mask and width.
// Returns the 64-bit payload the lane receives (the shuffled value, or the vote result).
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width, const char* file,
                         unsigned line);

// Static __shared__ storage: one allocation per call site (`site`) per block, the same pointer for
// every thread of the block; filled with 0xFF bytes (a NaN pattern) so reads before writes show up.
void* static_shared(const void* site, size_t bytes, size_t align);
// extern __shared__ storage of the size given at launch.
void* dynamic_shared();

// Ends the launch with `message` at file:line (a device-side check or a misuse the emulator detected).
// Takes no owning arguments: the calling fiber is abandoned without unwinding its stack.
[[noreturn]] void fail(const char* message, const char* file, unsigned line);

// For tests: the shape of the last launch on this thread, and how many blocks and fiber switches it ran.
struct LaunchStats {
  uint64_t blocks = 0;
  uint64_t switches = 0;
  unsigned threads_per_block = 0;
  unsigned cluster_blocks = 0;
  bool cooperative = false;
};
LaunchStats last_launch_stats();

}  // namespace specdec::sim
