// Tree speculative sampling: the per-request decision flow over a tree of candidates, shared by the CPU kernel
// and the CUDA kernel (which the emulator runs). The row operations are the chain op's engines
// (chain_sampling.h), so a tree's decisions and tokens are as bit-identical across backends as a chain's.
//
// The tree. Node 0 is the last emitted token; node c > 0 carries a candidate token x_c and has a parent
// parents[c] < c (so the nodes are in topological order, and a cycle or a parent after its child is malformed).
// p_n is the target's distribution at node n (its next-token distribution given the path to n). The children
// of n are tested in increasing node index, and siblings carry distinct tokens.
//
// The method, at the current node n (starting at the root), with r the residual and j = 1, 2, ... its children:
//   point proposals (no draft rows: deterministic top-k, n-gram, Medusa candidates). r_1 = p_n. Accept x_j
//     with probability r_j(x_j) / R_j, where R_j = 1 - p_n(x_1) - ... - p_n(x_{j-1}) is r_j's mass, r_j being
//     p_n with x_1 .. x_{j-1} removed (tested as u * R_j < p_n(x_j), no division).
//     Why it is lossless: P(emit x_j) = prod_{i<j} (1 - p(x_i) / R_i) * p(x_j) / R_j = (R_j / 1) * p(x_j) / R_j
//     = p(x_j), since 1 - p(x_i) / R_i = R_{i+1} / R_i telescopes; a token that is no candidate is drawn
//     from r after every child failed, with probability R_{m+1} * p(y) / R_{m+1} = p(y).
//   children sampled without replacement from the draft q_n (draft row n given). r_1 = p_n, q_1 = q_n. Accept
//     x_j with probability min(1, r_j(x_j) / q_j(x_j)); on rejection r_{j+1} = norm(max(0, r_j - q_j)) and
//     q_{j+1} = q_j with x_j removed, renormalised (recursive rejection sampling without replacement).
//     Why it is lossless: given the earlier draws and rejections, x_j ~ q_j (sampling without replacement),
//     so step j is one chain speculative step from r_j: it emits x_j or passes on with a law r_{j+1} that does
//     not depend on x_j. By induction from the last child (whose residual draw is exact), whatever leaves
//     step j is distributed as r_j, and so the node emits r_1 = p_n.
// Either way, an accepted child becomes the current node and the walk goes on below it; when every child of
// the current node is rejected (or it has none), the round's last token is drawn from r, and the round emits
// the accepted path's tokens and that one. Each emitted token is distributed as p given the tokens before it,
// which is the target's law of the sequence. Greedy requests (temperature 0) follow the target's argmax:
// to the child carrying it, else the argmax is the last token. With Gumbel coupling (P.gumbel) a sampled request
// does the same with the Gumbel-max sample of the node's row, its noise that of position offset[b] + the node's
// depth: siblings share a position, at most one child carries the sample, and every emitted token is the one plain
// decoding draws there.
//
// Randomness (the chain op's RNG contract): testing node c draws uniform c - 1 of kStreamAccept, the last token
// uniform 0 of kStreamResample; so a tree that is a chain draws exactly what the chain op draws, and emits
// the same tokens. A caller's uniforms replace them: uniforms[b, c] for node c (column 0, the root, unused) and
// final_uniforms[b] for the last token.
//
// Logits processing (top_k, top_p, min_p; row_filter.h): a sampled request's node rows, target and draft, are processed
// when the walk reaches the node, before anything reads them; p_n and q_n above are the processed distributions.
//
// Rounding. R_j and the mass left in q (Q_j) are kept by subtraction in float32; the residual's mass after a
// rejected sample, S_{j+1}, is a pass over the row in the canonical order (sampling_math.h), made only when
// another child is to be tested (the draw needs no normaliser). Where rounding leaves a residual without mass
// (r == q), the token comes from p_n itself, as in the chain op. Nothing but the row statistics and the
// per-level constants is ever stored: the distributions are recomputed entry by entry from the rows.
#pragma once
#include "chain_sampling.h"

namespace specdec {

constexpr int kMaxTreeNodes = 64;  // verify_attention's block limit

// Errors of malformed trees, next to SamplingError's bits.
enum TreeSamplingError : int32_t {
  kErrTreeParent = 64,          // the root's parent is not -1, or a node's parent is not an earlier node
  kErrNumNodes = 128,           // num_nodes outside [1, N]
  kErrDuplicateSibling = 256,   // two children of one node carry the same token
};

struct TreeSamplingParams {
  ChainSamplingParams rows;     // target/draft rows [B, N, V] (row n of the draft: what n's children were drawn
                                // from), greedy/temperature, seed, offset, error_flags, the flat form's
                                // cu_num_draft_tokens; its draft ids, counts and chain outputs are unused
  const int32_t* parents;       // [B, N], or [T + B] in the flat form (request b's k_b + 1 nodes from cu[b-1] + b)
  const void* token_ids;        // likewise, int32 or int64
  bool token_ids_int64;
  const int32_t* num_nodes;     // [B] (padded form)
  int32_t* output_token_ids;    // [B, N]
  int32_t* accepted_nodes;      // [B, N]
  int32_t* num_accepted;        // [B]
  int64_t nodes;                // N
};

// Where node c of request b is in parents, candidate_token_ids, the rows and uniforms: [B, N] padded, or from
// cu[b-1] + b in the flat form (a request's k_b drafts and its root: k_b + 1 nodes).
SPECDEC_HD int64_t tree_node_at(const TreeSamplingParams& T, int64_t b, int64_t c) {
  return T.rows.cu_num_draft_tokens == nullptr ? b * T.nodes + c : draft_start(T.rows, b) + b + c;
}
SPECDEC_HD int32_t tree_parent(const TreeSamplingParams& T, int64_t b, int64_t c) { return T.parents[tree_node_at(T, b, c)]; }
SPECDEC_HD int64_t tree_token(const TreeSamplingParams& T, int64_t b, int64_t c) {
  return T.token_ids_int64 ? static_cast<const int64_t*>(T.token_ids)[tree_node_at(T, b, c)]
                           : static_cast<const int32_t*>(T.token_ids)[tree_node_at(T, b, c)];
}
// Request b's node count, in [1, N] (1 for a flat request whose positions are inconsistent: it is never read).
SPECDEC_HD int32_t tree_num_nodes(const TreeSamplingParams& T, int64_t b) {
  if (T.rows.cu_num_draft_tokens != nullptr) {
    return request_rows_valid(T.rows, b) ? static_cast<int32_t>(given_num_drafts(T.rows, b)) + 1 : 1;
  }
  const int32_t n = T.num_nodes[b];
  return n < 1 ? 1 : n > T.nodes ? static_cast<int32_t>(T.nodes) : n;
}

// The acceptance draw of node c (> 0) of request b: the caller's uniforms[b, c], or uniform c - 1 of Philox stream 0
// (so that a chain-shaped tree draws what the chain op draws).
SPECDEC_HD float tree_accept_uniform(const TreeSamplingParams& T, int64_t b, int32_t c, uint64_t seed, uint64_t offset) {
  if (T.rows.uniforms != nullptr) return T.rows.uniforms[tree_node_at(T, b, c)];
  return philox_uniform_at(seed, offset, kStreamAccept, static_cast<uint64_t>(c - 1));
}

// The request's controls other than its nodes: the node count, the root, the temperature, the caller's uniforms.
SPECDEC_HD int32_t check_tree_request(const TreeSamplingParams& T, int64_t b) {
  int32_t bits = 0;
  if (!request_rows_valid(T.rows, b)) return kErrCuNumDraftTokens;
  if (T.num_nodes != nullptr && (T.num_nodes[b] < 1 || T.num_nodes[b] > T.nodes)) bits |= kErrNumNodes;
  if (T.rows.uniforms != nullptr) {
    for (int32_t c = 1; c < tree_num_nodes(T, b); ++c) {
      if (!uniform_valid(T.rows.uniforms[tree_node_at(T, b, c)])) bits |= kErrUniform;
    }
  }
  if (T.rows.final_uniforms != nullptr && !uniform_valid(T.rows.final_uniforms[b])) bits |= kErrUniform;
  if (tree_parent(T, b, 0) != -1) bits |= kErrTreeParent;
  if (T.rows.logits) {
    const float t = T.rows.temperature[b];
    if (!(t >= 0.0f) || !is_finite(t)) bits |= kErrTemperature;
  }
  return bits | check_row_filter(T.rows, b);
}

// What is wrong with node c (0 < c < num_nodes), from accessors parent(i) and token(i) of the request's nodes:
// its parent is not an earlier node, its token is outside [0, V), or an earlier sibling carries it. A node with
// errors is never a child (nor are its descendants, which it cannot reach); the CPU kernel raises.
template <typename Parent, typename Token>
SPECDEC_HD int32_t tree_node_errors(Parent&& parent, Token&& token, int32_t c, int64_t vocab) {
  const int32_t p = parent(c);
  if (p < 0 || p >= c) return kErrTreeParent;
  const int64_t x = token(c);
  if (x < 0 || x >= vocab) return kErrDraftTokenId;
  for (int32_t i = 1; i < c; ++i) {
    if (parent(i) == p && token(i) == x) return kErrDuplicateSibling;
  }
  return 0;
}

// The residual a node's sampling has reached after L rejected children (levels), and what the last token is
// drawn from. Level i < L holds the i-th rejected child's token removed[i] and, with draft rows, inv_q[i] =
// 1 / Q_i (the draft's mass left before it; 0 if none is) and inv_s[i] = 1 / S_{i+1} (or 1 where no
// normaliser was needed). The arrays live where the engine keeps them (shared memory on CUDA).
struct TreeMass {
  bool logits;
  bool p_only;   // the mass is p itself (a residual without mass)
  bool has_q;    // children sampled from draft rows; else point proposals
  int32_t levels;
  const int32_t* removed;
  const float* inv_q;
  const float* inv_s;
  float scale;
  SoftmaxNorm norm_p, norm_q;  // logits: the rows' normalisers (sampling_math.h)
};

// Where an engine keeps a node's levels (kMaxTreeNodes entries each).
struct TreeLevels {
  int32_t* removed;
  float* inv_q;
  float* inv_s;
};

// r_L(v) from the raw row values pv and qv: the residual after `levels` rejections, each level normalised by
// its inv_s (so r is the normalised residual where every inv_s is set, and the unnormalised one where the last
// is 1). Point proposals: p(v), or 0 once v was rejected.
SPECDEC_HD float tree_residual(const TreeMass& s, int32_t levels, int32_t v, float pv, float qv) {
  const float p = s.logits ? softmax_prob(pv, s.scale, s.norm_p) : pv;
  if (s.p_only) return p > 0.0f ? p : 0.0f;
  if (!s.has_q) {
    for (int32_t i = 0; i < levels; ++i) {
      if (s.removed[i] == v) return 0.0f;
    }
    return p > 0.0f ? p : 0.0f;
  }
  const float q = s.logits ? softmax_prob(qv, s.scale, s.norm_q) : qv;
  float r = p;
  bool removed = false;  // v was rejected at an earlier level: q_i(v) = 0 from the next level on
  for (int32_t i = 0; i < levels; ++i) {
    const float qi = removed ? 0.0f : fmul(q, s.inv_q[i]);
    const float d = fadd(r, -qi);
    r = fmul(d > 0.0f ? d : 0.0f, s.inv_s[i]);
    removed = removed || s.removed[i] == v;
  }
  return r > 0.0f ? r : 0.0f;
}

// The engines' mass of entry v (chain_sampling.h's entry_mass for a tree).
SPECDEC_HD float entry_mass(const TreeMass& s, int32_t v, float pv, float qv, bool) {
  return tree_residual(s, s.levels, v, pv, qv);
}

// Node indices of the accepted path (0, then each accepted node) into accepted_nodes[b], -1 after it; the
// path's tokens, then `token`, into output_token_ids[b], -1 after it. Run by one thread.
SPECDEC_HD void write_tree_outputs(const TreeSamplingParams& T, int64_t b, int32_t node, int32_t depth, int32_t token) {
  int32_t* nodes = T.accepted_nodes + b * T.nodes;
  int32_t* tokens = T.output_token_ids + b * T.nodes;
  for (int64_t j = depth + 1; j < T.nodes; ++j) nodes[j] = tokens[j] = -1;
  tokens[depth] = token;
  for (int32_t d = depth; d > 0; --d) {
    nodes[d] = node;
    tokens[d - 1] = static_cast<int32_t>(tree_token(T, b, node));
    node = tree_parent(T, b, node);
  }
  nodes[0] = 0;
  T.num_accepted[b] = depth;
}

// The flow for one request. Engine supplies, besides the chain engine's row operations (row_target,
// row_draft, load, argmax, softmax_stats, sample and total over a TreeMass, flag):
//   load_tree(b, n): the request's nodes (flagging malformed ones); parent(c), token(c), valid(c);
//   levels() -> TreeMass arrays; set_level(i, removed, inv_q, inv_s); write_tree(b, node, depth, token).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // instantiated with a device engine (CUDA) or a host one (CPU)
#endif
template <typename Engine>
SPECDEC_FLOW void tree_sampling_request(Engine& e, const TreeSamplingParams& T, int64_t b) {
  const ChainSamplingParams& P = T.rows;
  e.flag(check_tree_request(T, b));
  if (!request_rows_valid(P, b)) {  // a flat request whose nodes cannot be found emits nothing
    e.write_tree(b, 0, 0, -1);
    return;
  }
  const int32_t n = tree_num_nodes(T, b);
  e.load_tree(b, n);
  float scale;
  const bool greedy = request_greedy(P, b, &scale);
  const uint64_t seed = static_cast<uint64_t>(P.seed[b]), offset = static_cast<uint64_t>(P.offset[b]);
  const bool has_q = P.draft != nullptr;
  // The next child of `node` after node index `after`, or -1.
  const auto next_child = [&](int32_t node, int32_t after) {
    for (int32_t c = after + 1; c < n; ++c) {
      if (e.valid(c) && e.parent(c) == node) return c;
    }
    return -1;
  };

  int32_t node = 0, depth = 0, token = -1;
  for (;;) {
    int32_t child = next_child(node, node);
    const bool node_q = has_q && child >= 0;  // a node without children never reads its draft row
    const auto* row_p = e.row_target(b, node);
    const auto* row_q = node_q ? e.row_draft(b, node) : nullptr;
    filter_rows(e, P, b, greedy, row_p, row_q, scale);
    if (greedy || P.gumbel) {  // the target's token at this depth; the child carrying it, if any, is accepted
      const int32_t best = greedy ? e.argmax(row_p) : e.gumbel_argmax(row_p, scale, seed, offset + depth);
      while (child >= 0 && e.token(child) != best) child = next_child(node, child);
      if (best >= 0 && child >= 0) {
        node = child;
        ++depth;
        continue;
      }
      token = best;
      break;
    }
    TreeMass spec{P.logits, false, node_q, 0, e.levels().removed, e.levels().inv_q, e.levels().inv_s,
                  scale, {}, {}};
    if (P.logits) logits_norms(e, P, b, node, row_p, row_q, scale, &spec.norm_p, &spec.norm_q);
    float mass_left = 1.0f;  // R_j (point proposals) or Q_j (the draft's mass not yet drawn)
    int32_t accepted = -1;
    while (child >= 0) {
      const int32_t x = static_cast<int32_t>(e.token(child));
      const float pv = e.load(row_p, x, true), qv = node_q ? e.load(row_q, x, false) : 0.0f;
      const float u = tree_accept_uniform(T, b, child, seed, offset);
      const float inv_q = mass_left > 0.0f ? fdiv(1.0f, mass_left) : 0.0f;
      float p_x;  // p_n(x), for point proposals' R
      bool accept;
      if (!node_q) {
        p_x = tree_residual(spec, 0, x, pv, 0.0f);
        accept = fmul(u, mass_left) < p_x;
      } else {
        const float r_x = tree_residual(spec, spec.levels, x, pv, qv);
        p_x = P.logits ? softmax_prob(qv, scale, spec.norm_q) : qv;  // q_n(x), for Q
        const float q_x = fmul(p_x, inv_q);
        accept = q_x > 0.0f && fmul(u, q_x) < r_x;
      }
      if (accept) {
        accepted = child;
        break;
      }
      const int32_t next = next_child(node, child);
      if (spec.levels >= kMaxTreeNodes) break;  // unreachable: a node has fewer than kMaxTreeNodes children
      e.set_level(spec.levels, x, inv_q, 1.0f);
      ++spec.levels;
      mass_left = fadd(mass_left, -p_x);
      if (node_q && next >= 0) {  // the next test needs r_{j+1} normalised
        const float s = e.total(row_p, row_q, spec);
        if (!(s > 0.0f) || !is_finite(s)) {
          spec.p_only = true;  // r == q: the residual has no mass
          break;
        }
        e.set_level(spec.levels - 1, x, inv_q, fdiv(1.0f, s));
      }
      child = next;
    }
    if (accepted >= 0) {
      node = accepted;
      ++depth;
      continue;
    }
    const float u_resample = final_uniform(P, b, seed, offset);
    token = e.sample(row_p, row_q, spec, u_resample);
    if (token < 0 && !spec.p_only) {  // the residual has no mass: sample p itself
      spec.p_only = true;
      token = e.sample(row_p, nullptr, spec, u_resample);
    }
    break;
  }
  if (token < 0) e.flag(kErrTargetNoMass);
  e.write_tree(b, node, depth, token);
}

}  // namespace specdec
