// Tree speculative sampling on the GPU: tree_sampling_request (specdec/tree_sampling.h) on the chain kernel's
// engine, one group of blocks per request (its slices), so that every row operation is the chain kernel's (same
// lanes, same bits). The request's nodes and the current node's levels are kept in shared memory: the flow
// reads them in every thread (broadcast reads), and the residual reads the levels at every entry.
//
// Bytes: per visited node, with logits, one statistics pass over its target row and (when it has children
// sampled from q) its draft row; a rejected child sampled from q costs one more pass over both when another
// child follows; the last token one more. Nodes off the accepted path are never read.
#pragma once
#include "kernels/chain_sampling.cuh"
#include "specdec/tree_sampling.h"

namespace specdec {

template <typename T, int kSlices>
struct TreeSlicedEngine : SlicedSamplingEngine<T, kSlices> {
  using Base = SlicedSamplingEngine<T, kSlices>;
  const TreeSamplingParams* tree;  // the kernel's copy of its parameters
  int32_t* node_parent;   // [kMaxTreeNodes]: the request's nodes, copied once
  int64_t* node_token;    // [kMaxTreeNodes]
  int32_t* node_valid;    // [kMaxTreeNodes]
  int32_t* level_removed;  // [kMaxTreeNodes] each: the current node's levels (TreeLevels)
  float* level_inv_q;
  float* level_inv_s;

  SPECDEC_DEVICE int32_t parent(int32_t c) const { return node_parent[c]; }
  SPECDEC_DEVICE int64_t token(int32_t c) const { return node_token[c]; }
  SPECDEC_DEVICE bool valid(int32_t c) const { return node_valid[c] != 0; }

  SPECDEC_DEVICE void load_tree(int64_t b, int32_t n) {
    sync_threads();  // the previous request's nodes are no longer read
    for (int c = static_cast<int>(threadIdx.x); c < n; c += Base::kThreads) {  // the request's nodes only
      node_parent[c] = tree_parent(*tree, b, c);
      node_token[c] = tree_token(*tree, b, c);
    }
    sync_threads();
    for (int c = static_cast<int>(threadIdx.x); c < n; c += Base::kThreads) {  // a block of 32 threads checks 2 each
      if (c == 0) continue;
      const int32_t bits = tree_node_errors([&](int32_t i) { return node_parent[i]; }, [&](int32_t i) { return node_token[i]; },
                                            c, tree->rows.vocab);
      node_valid[c] = bits == 0;
      this->flag(bits);
    }
    sync_threads();
  }

  SPECDEC_DEVICE TreeLevels levels() const { return TreeLevels{level_removed, level_inv_q, level_inv_s}; }
  SPECDEC_DEVICE void set_level(int32_t i, int32_t x, float inv_q, float inv_s) {
    sync_threads();  // no thread still reads the levels of a test or a pass before this one
    if (threadIdx.x == 0) {
      level_removed[i] = x;
      level_inv_q[i] = inv_q;
      level_inv_s[i] = inv_s;
    }
    sync_threads();
  }

  SPECDEC_DEVICE void write_tree(int64_t b, int32_t node, int32_t depth, int32_t token) {
    if (this->rank == 0 && threadIdx.x == 0) write_tree_outputs(*tree, b, node, depth, token);
  }
};

template <typename T, int kSlices>
__global__ void __launch_bounds__(kLanes / kSlices, 1) tree_sampling_kernel(const TreeSamplingParams params,
                                                                            const SliceWorkspace workspace) {
  using Engine = TreeSlicedEngine<T, kSlices>;
  const TreeSamplingParams TP = params;
  SPECDEC_SHARED(float, group_totals, kTileChunk * kGroups);
  SPECDEC_SHARED(float, tile_totals, kMaxTiles);
  SPECDEC_SHARED(float, lane_sums, kGroup);
  SPECDEC_SHARED(MaxSumPair, ms_scratch, kGroups);
  SPECDEC_SHARED(ArgMax, am_scratch, kGroups);
  SPECDEC_SHARED(int32_t, int_scratch, 2);
  SPECDEC_SHARED(float, float_scratch, 2);
  SPECDEC_SHARED(int32_t, node_parent, kMaxTreeNodes);
  SPECDEC_SHARED(int64_t, node_token, kMaxTreeNodes);
  SPECDEC_SHARED(int32_t, node_valid, kMaxTreeNodes);
  SPECDEC_SHARED(int32_t, level_removed, kMaxTreeNodes);
  SPECDEC_SHARED(float, level_inv_q, kMaxTreeNodes);
  SPECDEC_SHARED(float, level_inv_s, kMaxTreeNodes);
  const unsigned group = blockIdx.x / kSlices;
  if (kSlices > 1 && (gridDim.x % kSlices != 0 || workspace.arrivals == nullptr)) {
    invariant_failed("tree_sampling_kernel: a grid of whole request groups, with their workspace");
  }
  Engine engine{{TP.rows, blockIdx.x % kSlices, kSlices > 1 ? workspace.exchange + group : nullptr,
                 kSlices > 1 ? workspace.arrivals + group : nullptr, group_totals, tile_totals, lane_sums, ms_scratch,
                 am_scratch, int_scratch, float_scratch, /*gathered_pq: the chain flow's*/ nullptr, 0},
                &TP, node_parent, node_token, node_valid, level_removed, level_inv_q, level_inv_s};
  const int64_t groups = gridDim.x / kSlices;
  for (int64_t b = group; b < TP.rows.batch; b += groups) tree_sampling_request(engine, TP, b);
  if (engine.errors != 0 && TP.rows.error_flags != nullptr) atomic_or(TP.rows.error_flags, engine.errors);
}

}  // namespace specdec
